"""Preemption as SLURM and torchrun deliver it: SIGUSR1 or SIGTERM to one rank, to a rank's whole
process group (its data workers included), or during start-up; checkpoint, exit 85, the requeued
run resumes at the same batch. (Under a real Slurm: test_slurm_cluster.py.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.launch_harness import LAUNCHER_VARIABLES, read_keys, srun_like, wait_all, wait_for_step
from support.train_harness import demo_argv
from torch.utils.data import IterableDataset

from bigclip.distributed import free_port
from bigclip.train.preemption import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.dist


def test_sigusr1_checkpoints_exits_for_requeue_and_resumes_at_the_same_batch(demo_data, tmp_path):
    def argv(name: str) -> list[str]:
        return demo_argv(demo_data, tmp_path, "--max-steps", "14", "--resume", "latest", "--save-every-n-steps", "0",
                         "--save-frequency", "0", "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"),
                         "--batch-keys-file", str(tmp_path / f"keys-{name}"), name=name)  # fmt: skip

    reference = srun_like(argv("reference"), 2, tmp_path)
    assert wait_all(reference) == [0, 0]

    job = argv("job")
    first = srun_like(job, 2, tmp_path)
    wait_for_step(tmp_path / "keys-job", 3, first)
    first[1].send_signal(signal.SIGUSR1)  # one rank is enough: the ranks agree at the step boundary
    assert wait_all(first) == [REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE]
    stopped_at = max(read_keys(tmp_path / "keys-job", 0)) + 1  # steps taken before the checkpoint
    assert (tmp_path / "ckpt-job" / f"step_{stopped_at:08d}" / "manifest.json").exists()

    requeued = srun_like(job, 2, tmp_path)  # the same command line, as a requeued job runs it
    assert wait_all(requeued) == [0, 0]
    for rank in range(2):
        keys, expected = read_keys(tmp_path / "keys-job", rank), read_keys(tmp_path / "keys-reference", rank)
        assert min(k for k in keys if k >= stopped_at) == stopped_at  # resumed at the exact step
        assert keys[stopped_at] == expected[stopped_at]  # with the same next batch
        assert keys == expected  # and the same stream to the end


class _Slow(IterableDataset):
    def __iter__(self):
        for i in range(10_000):
            time.sleep(0.01)
            yield torch.tensor([i])


def test_data_workers_outlive_signals_to_their_group_and_still_stop_with_their_rank(tmp_path):
    """killpg(SIGTERM/SIGUSR1) from outside (torchrun, Slurm's linuxproc) leaves the workers running;
    a rank that leaves on an exception without closing its loader still exits (no hang at exit)."""
    code = f"""
import os, signal, subprocess, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torch
from torch.utils.data import DataLoader
from test_preemption import _Slow
from bigclip.data.worker_signals import shield_worker
from bigclip.train import phases
from bigclip.train.signals import catch_preemption_signals
flag = catch_preemption_signals()
phases.begin("training", on_stop=phases.OnStop.AT_BOUNDARY, base=True)  # a rank past its first step
batches = iter(DataLoader(_Slow(), batch_size=None, num_workers=2, multiprocessing_context="fork",
                          worker_init_fn=shield_worker))
for i, _ in enumerate(batches):
    if i in (5, 10):
        sig = "TERM" if i == 5 else "USR1"
        subprocess.run(["kill", "-" + sig, "--", f"-{{os.getpgid(0)}}"], check=True, start_new_session=True)
    if i == 40:
        print("caught", signal.Signals(flag.signum).name, flush=True)
        raise SystemExit(3)  # leaving with the loader open: multiprocessing must still reap the workers
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          start_new_session=True)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "caught SIGTERM" in done.stdout and "DataLoader worker" not in done.stderr


def test_torchrun_layout_sigterm_with_workers_checkpoints_and_resumes(demo_data, tmp_path):
    """torchrun passes SIGTERM to each rank's process group (the data workers included); the ranks
    checkpoint that step and exit 85, rank 0 writes the marker; the rerun resumes there exactly."""
    argv = demo_argv(demo_data, tmp_path, "--max-steps", "14", "--resume", "latest", "--save-every-n-steps", "4",
                     "--save-frequency", "0", "--workers", "2", "--batch-keys-file", str(tmp_path / "keys"),
                     name="tr")  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", "-m", "bigclip.train", "--", *argv]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}
    log = open(tmp_path / "torchrun.log", "ab")  # noqa: SIM115 (owned by the child process)
    first = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_for_step(tmp_path / "keys", 5, [first])
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=300)
    marker = json.loads((tmp_path / "tr" / "requeue.json").read_text())
    assert marker["signal"] == "SIGTERM" and marker["step"] >= 5, (tmp_path / "torchrun.log").read_text()[
        -3000:
    ]
    before = [read_keys(tmp_path / "keys", r) for r in range(2)]
    requeued = srun_like(argv, 2, tmp_path)
    assert wait_all(requeued) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    assert f"at step {marker['step']} " in (tmp_path / "rank0.log").read_text()
    for rank in range(2):
        after = read_keys(tmp_path / "keys", rank)
        assert sorted(after) == list(range(14))
        assert all(after[s] == before[rank][s] for s in before[rank] if s < marker["step"])


DOORS = {
    "python -m bigclip.train": ["-m", "bigclip.train"],
    "bigclip train": ["-m", "bigclip.cli", "train"],  # what the console script runs: bigclip.cli:main
}


def signal_during_start_up(proc: subprocess.Popen) -> str:
    """SIGUSR1 as soon as the process either catches it or has loaded torch, whichever comes first
    (so a process that imports torch before installing its handlers gets it unhandled); returns which."""
    status, maps = Path(f"/proc/{proc.pid}/status"), Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        caught = next(line for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
        if int(caught.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1:
            which = "handlers first"
        elif "libtorch" in maps.read_text():
            which = "torch first"
        else:
            time.sleep(0.001)
            continue
        proc.send_signal(signal.SIGUSR1)
        return which
    raise AssertionError(f"the process neither caught SIGUSR1 nor loaded torch (exit {proc.poll()})")


@pytest.mark.parametrize("door", list(DOORS))
def test_a_signal_during_start_up_does_not_kill_the_rank(demo_data, tmp_path, door):
    """SIGUSR1 before torch is imported: caught (signals.py), said, and honoured at once (nothing
    trained yet, nothing to checkpoint: exit 85), the same through both entry points
    (train/entry.py). Each later phase: test_stop_signals.py."""
    argv = demo_argv(demo_data, tmp_path, "--max-steps", "5", "--save-frequency", "0", name="early")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    proc = subprocess.Popen([sys.executable, *DOORS[door], *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    which = signal_during_start_up(proc)
    out, _ = proc.communicate(timeout=300)
    assert (which, proc.returncode) == ("handlers first", REQUEUE_EXIT_CODE), out[-3000:]
    said = "SIGUSR1 received during start-up: no step taken since the run started, nothing to checkpoint"
    assert said in out
    assert "Traceback" not in out and "Train Epoch" not in out
