"""The step watchdog on 3 real gloo ranks: a stopped rank ends the run for a requeue, named by
the others; a killed rank makes the others fail fast; the requeued run resumes from the last
committed checkpoint with the same batches."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch_harness import read_keys, srun_like, wait_all, wait_for_step
from support.train_harness import demo_argv

from bigclip.distributed import free_port
from bigclip.train.preemption import REQUEUE_EXIT_CODE
from bigclip.train.watchdog import AUTO_FLOOR_S, step_limit

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STEP_TIMEOUT = 10
SLACK_S = 25  # process start-up noise on a shared 2-core box, beyond the watchdog's own ~1.2x


def _argv(demo_data, tmp_path: Path, name: str) -> list[str]:
    return demo_argv(demo_data, tmp_path, "--epochs", "3", "--max-steps", "16", "--resume", "latest",
                     "--save-every-n-steps", "4", "--save-frequency", "0", "--step-timeout", str(STEP_TIMEOUT),
                     "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), "--batch-keys-file",
                     str(tmp_path / f"keys-{name}"), name=name)  # fmt: skip


def _log(tmp_path: Path, rank: int) -> str:
    return (tmp_path / f"rank{rank}.log").read_text(errors="replace")


def _committed_steps(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in ckpt_dir.glob("step_*/manifest.json"))


def test_step_limit_policy() -> None:
    assert step_limit(-1, [1.0] * 50) is None  # off
    assert step_limit(7, []) == 7  # explicit: from the first step on
    assert step_limit(0, [1.0] * 9) is None  # auto: not before 10 timed steps
    assert step_limit(0, [1.0] * 10) == AUTO_FLOOR_S  # the floor
    assert step_limit(0, [50.0] * 9 + [1.0] * 4) == 500.0  # 10x the median


def test_stopped_rank_is_named_and_the_run_requeues_then_resumes(demo_data, tmp_path: Path) -> None:
    argv = _argv(demo_data, tmp_path, "hang")
    first = srun_like(argv, 3, tmp_path)
    wait_for_step(tmp_path / "keys-hang", 7, first)
    first[2].send_signal(signal.SIGSTOP)  # a frozen node, as far as the others can tell
    stopped_at = time.monotonic()
    try:
        codes = [p.wait(timeout=STEP_TIMEOUT * 1.2 + SLACK_S) for p in first[:2]]
        took = time.monotonic() - stopped_at
    finally:
        first[2].kill()
        first[2].wait()
    assert codes == [REQUEUE_EXIT_CODE] * 2, _log(tmp_path, 0)[-3000:]
    for rank in (0, 1):
        log = _log(tmp_path, rank)
        assert "no step finished for" in log and "not answering" in log and "ranks [2]" in log, log[-3000:]
        assert re.search(r"rank 2: SILENT, last seen after step \d+ in ", log), log[-3000:]
        assert "Thread 0x" in log  # faulthandler's stack dump
    marker = json.loads((tmp_path / "hang" / "requeue.json").read_text())
    assert marker["reason"] == "hung" and marker["silent_ranks"] == [2]
    print(f"stopped rank -> others exited {REQUEUE_EXIT_CODE} after {took:.1f} s (limit {STEP_TIMEOUT} s)")

    committed = _committed_steps(tmp_path / "ckpt-hang")[-1]
    before = [read_keys(tmp_path / "keys-hang", r) for r in range(3)]
    requeued = srun_like(argv, 3, tmp_path)  # what the requeued job runs
    assert wait_all(requeued) == [0, 0, 0], _log(tmp_path, 0)[-3000:]
    assert f"at step {committed}" in _log(tmp_path, 0).split("resumed")[-1].splitlines()[0]
    for rank in range(3):
        after = read_keys(tmp_path / "keys-hang", rank)  # the same file: rows of the rerun win
        redone = [s for s in before[rank] if s >= committed]
        assert redone and all(after[s] == before[rank][s] for s in redone)  # the same batches again
        assert max(after) == 15


def test_killed_rank_makes_the_others_fail_fast_naming_it(demo_data, tmp_path: Path) -> None:
    first = srun_like(_argv(demo_data, tmp_path, "dead"), 3, tmp_path)
    wait_for_step(tmp_path / "keys-dead", 5, first)
    os.kill(first[1].pid, signal.SIGKILL)  # out of memory, as far as the others can tell
    killed_at = time.monotonic()
    codes = [first[r].wait(timeout=STEP_TIMEOUT * 1.2 + SLACK_S) for r in (0, 2)]
    took = time.monotonic() - killed_at
    assert all(code not in (0, None) for code in codes), codes
    for rank in (0, 2):
        log = _log(tmp_path, rank)
        assert "ranks [1]" in log and "not answering" in log, log[-3000:]
    print(f"killed rank -> others exited {codes} after {took:.1f} s")


PEER = """
import sys, time, torch, torch.distributed as dist
from bigclip.distributed import cpu_group, init_distributed
init_distributed(backend="gloo", timeout_s=3)
if dist.get_rank() == 1:
    time.sleep(30)  # alive, but never joins the collective below
    sys.exit(0)
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=cpu_group())
except Exception as e:
    print(f"failed after {time.monotonic() - start:.1f} s: {type(e).__name__}")
"""


def test_dist_timeout_bounds_every_collective(tmp_path: Path) -> None:
    """--dist-timeout reaches the process group: a peer that never shows up is an error, not a wait."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "SLURM_NTASKS": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", PEER], env=env | {"SLURM_PROCID": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]  # fmt: skip
    try:
        out, _ = procs[0].communicate(timeout=60)
    finally:
        procs[1].kill()
        procs[1].wait()
    found = re.search(r"failed after ([\d.]+) s", out)
    assert found and 2.5 < float(found.group(1)) < 20, out[-2000:]


BLOCKED = """
import os, signal, sys, time, torch, torch.distributed as dist
from types import SimpleNamespace
from bigclip.distributed import init_distributed
from bigclip.train.watchdog import StepWatchdog
runtime = init_distributed(backend="gloo", timeout_s=120)
ranks_0_2 = dist.new_group([0, 2])
cfg = SimpleNamespace(engine=SimpleNamespace(step_timeout=10))  # beats every second; no step timed
watchdog = StepWatchdog.start_for(cfg, runtime, sys.argv[1])
dist.barrier()
if runtime.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if runtime.rank == 0:
    time.sleep(1)
    try:
        dist.all_reduce(torch.ones(1))  # needs rank 1: fails
    except RuntimeError as e:
        watchdog.explain_failure(e)
        sys.exit(1)
dist.all_reduce(torch.ones(1), group=ranks_0_2)  # waits for rank 0, which is past its error
"""


def test_a_rank_blocked_on_a_failed_peer_names_the_dead_rank_too(tmp_path: Path) -> None:
    """Rank 2 waits in a collective for rank 0, alive but past the error that rank 1's death
    caused: without the announcement it would learn of it only when rank 0 exits, taking the
    store (and so the roll call) with it, or after the group's 120 s timeout."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "SLURM_NTASKS": "3",
        "OMP_NUM_THREADS": "1",
    }
    procs = [subprocess.Popen([sys.executable, "-c", BLOCKED, str(tmp_path)], env=env | {"SLURM_PROCID": str(r)},
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(3)]  # fmt: skip
    try:
        outs = {r: procs[r].communicate(timeout=60)[0] for r in (2, 0)}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[2].returncode == 1, outs[2][-3000:]
    assert "rank 0 stopped on an error after step 0 (RuntimeError: " in outs[2], outs[2][-3000:]
    assert "not answering" in outs[2] and "ranks [1]" in outs[2], outs[2][-3000:]
    assert "ranks [1]" in outs[0], outs[0][-3000:]
