"""`bigclip slurm --launcher deepspeed`: the script's hostfile and per-node DeepSpeed command (as
bash builds them, parsed by DeepSpeed's own runner and by bigclip), bigclip.launch.deepspeed_node's
errors, and, on real processes without Slurm, the signal path: SIGUSR1 to every process of the
node (what Slurm's time-limit warning does) leaves DeepSpeed's launchers standing while the ranks
checkpoint that step and exit 85 through them. Under a real two-node Slurm, preemption:
tests/test_slurm_two_nodes.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.launch_harness import read_keys
from support.train_harness import demo_argv

from bigclip.cli_args import parse_train_args
from bigclip.distributed import free_port
from bigclip.launch.deepspeed_node import runner_argv
from bigclip.launch.slurm import main as slurm_main
from bigclip.train.signals import requeue_marker_path

ROOT = Path(__file__).resolve().parents[1]
SCONTROL = '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a17\\ngpu-b03\\n"\n'


def _script(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "job.sbatch"
    assert slurm_main(["--nodes", "2", "--gpus-per-node", "8", "--launcher", "deepspeed", "--model", "tiny", "--train-data", "/data/{0..9}.tar",
                       "--engine", "deepspeed", "--deepspeed-config", "zero3", "--logs", str(tmp_path / "logs"),
                       "--name", "run", *extra, "-o", str(out)]) == 0  # fmt: skip
    return out


def _node_command(tmp_path: Path, script: Path) -> list[str]:
    """Run the script's launch block with srun and scontrol stand-ins: the hostfile it writes, and
    the arguments srun starts on each node (as bash expands them)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$RECORD"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    text = script.read_text()
    block = text[text.index("TRAIN_ARGS=(") : text.index("LAUNCHER_PID=$!")].replace(" &\n", "\n")
    prelude = (
        f'RUN_DIR="{tmp_path}" MASTER_ADDR=gpu-a17 MASTER_PORT=21234 SLURM_JOB_NODELIST="gpu-[a17,b03]"\n'
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "argv")}
    subprocess.run(
        ["bash", "-c", prelude + block.replace('echo "bigclip sbatch', ': "')], env=env, check=True
    )
    return (tmp_path / "argv").read_bytes().decode().split("\0")[:-1]


def test_each_node_runs_deepspeed_no_ssh_with_its_node_rank_and_the_allocation_hostfile(
    tmp_path: Path,
) -> None:
    from deepspeed.launcher.runner import fetch_hostfile
    from deepspeed.launcher.runner import parse_args as deepspeed_args

    script = _script(tmp_path)
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1\n" in text and "#SBATCH --cpus-per-task=96\n" in text  # 8 ranks x 12
    argv = _node_command(tmp_path, script)
    assert argv[:5] == [
        "--kill-on-bad-exit=1",
        "--ntasks-per-node=1",
        "python",
        "-m",
        "bigclip.launch.deepspeed_node",
    ]
    assert fetch_hostfile(str(tmp_path / "hostfile")) == {"gpu-a17": 8, "gpu-b03": 8}  # node-rank order
    runner = runner_argv(argv[5:], env={"SLURM_NODEID": "1"})
    assert runner[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    args = deepspeed_args(runner[4:])
    assert (args.no_ssh, args.node_rank, args.hostfile, args.module) == (
        True,
        1,
        str(tmp_path / "hostfile"),
        True,
    )
    assert (args.master_addr, args.master_port, args.user_script) == ("gpu-a17", 21234, "bigclip.train")
    cfg = parse_train_args(args.user_args)
    assert (cfg.engine.engine, cfg.checkpoint.resume, cfg.log.name) == ("deepspeed", "latest", "run")


def test_deepspeed_node_needs_slurm_node_id_and_sets_the_node_rank_itself() -> None:
    with pytest.raises(SystemExit, match="SLURM_NODEID is not set: run it under srun"):
        runner_argv(["--no_ssh", "--module", "bigclip.train"], env={})
    with pytest.raises(SystemExit, match="give no --node_rank"):
        runner_argv(["--node_rank=0", "--module", "bigclip.train"], env={"SLURM_NODEID": "0"})


@pytest.mark.slow
@pytest.mark.dist
def test_sigusr1_to_every_process_leaves_the_launchers_and_the_ranks_checkpoint_that_step(
    tmp_path: Path, demo_data
) -> None:
    """One node, 2 ranks, through deepspeed_node as the script starts it; the signal goes to every
    process at once, as Slurm's proctrack does (launchers, ranks, data workers)."""
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    keys = tmp_path / "keys"
    argv = demo_argv(demo_data, tmp_path, "--max-steps", "40", "--log-every-n-steps", "1", "--batch-keys-file",
                     str(keys), "--save-every-n-steps", "100", name="ds")  # fmt: skip
    command = [sys.executable, "-m", "bigclip.launch.deepspeed_node", "--no_ssh", f"--hostfile={tmp_path / 'hostfile'}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--module", "bigclip.train", *argv]  # fmt: skip
    env = {**os.environ, "SLURM_NODEID": "0", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}  # fmt: skip
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        node = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while max(read_keys(keys, 0), default=-1) < 1:
        assert node.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
    tree = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    assert len(tree) >= 6, tree  # runner, launch, 2 ranks, a data worker each
    for proc in tree:
        proc.send_signal(signal.SIGUSR1)
    code, text = node.wait(timeout=300), log.read_text()
    assert code == 85, text[-4000:]  # the ranks' requeue code, passed on by both launchers
    marker = json.loads(requeue_marker_path(tmp_path / "ds").read_text())  # the ranks' env is this one's
    assert marker["signal"] == "SIGUSR1" and marker["step"] < 40, marker
    assert (tmp_path / "ds" / "checkpoints" / f"step_{marker['step']:08d}").is_dir()
    assert "DataLoader worker" not in text and "Traceback" not in text, text[-4000:]
