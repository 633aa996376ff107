"""Scripts rendered by `bigclip slurm`, run by a real Slurm (Debian's slurm-wlm 22.05 + munge, one
node, tests/support/slurm_cluster.py) on 2 CPU ranks of the tiny model with 2 data workers each.

Each path is requeued, and every rerun resumes at the step the run before it was stopped at (not
an earlier periodic checkpoint) with the batches of an uninterrupted run, to its final checkpoint:
  (a) `scontrol requeue` (SIGTERM to every process; Slurm requeues), srun, GPU count without GRES;
  (b) SIGTERM to the steps (`scancel --signal=TERM`, what preemption sends), torchrun, ZeRO-3.
The requeues are not counted exactly (tests/support/requeues.py says why); what a user relies on is.
Partition preemption and the time-limit warning (`#SBATCH --signal=USR1@S`) take the same path
through the script on two nodes in tests/test_slurm_two_nodes_faults.py (one cluster run covers
both; running them here again doubled this file's time for no path of its own).
The uninterrupted reference trains until the test cancels it, once it is ahead of both (so no
assertion depends on how fast the box is): a cancelled job checkpoints and stays cancelled.
All three jobs run at once; a driver thread injects each fault. The waits follow the machine
(tests/support/slurm_waits.py): they last while the jobs move.
Without root or Slurm the tests skip with the reason; with CI set they fail instead.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.launch_harness import read_keys
from support.requeues import assert_committed, assert_requeued_and_resumed_exactly
from support.slurm_cluster import SlurmCluster, missing_reason, start_for_tests
from support.slurm_waits import Patience, file_size, rank_start_up_s, stall_limit_s

from bigclip.launch.slurm import main as slurm_main

pytestmark = [pytest.mark.slow, pytest.mark.dist]
ROOT = Path(__file__).resolve().parents[1]
TRIGGER_STEP = 5
SAVE_EVERY = 8
SHORT, ENDLESS = 40, 960  # steps: (b) and (c); the reference (stopped by the test)


@dataclass
class Scenario:
    name: str
    partition: str
    job_args: list[str]
    steps: int
    fault: Callable[[SlurmCluster, int], None] | None = None  # injected once the job is at TRIGGER_STEP
    train_args: list[str] = field(default_factory=list)
    job_id: int = 0
    fault_at: float = 0.0

    def keys_prefix(self, root: Path) -> Path:
        return root / self.name / "keys"


def _requeue(cluster: SlurmCluster, job_id: int) -> None:
    cluster.run("scontrol", "requeue", str(job_id))


def _sigterm_steps(cluster: SlurmCluster, job_id: int) -> None:
    cluster.run("scancel", "--signal=TERM", str(job_id))


CPU_RANKS = ["--gpus-per-node", "0", "--ranks-per-node", "2"]
SCENARIOS = [
    Scenario("reference", "batch", CPU_RANKS, ENDLESS),
    Scenario("requeued", "batch", ["--gpus-per-node", "2", "--gres", "none"], SHORT, _requeue),
    Scenario(
        "torchrun",
        "batch",
        [*CPU_RANKS, "--launcher", "torchrun"],
        SHORT,
        _sigterm_steps,
        ["--engine", "deepspeed", "--deepspeed-config", str(ROOT / "ds_configs/zero3.json")],
    ),  # fmt: skip
]
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
EXPECTED = {  # the signal the ranks saw first, and who requeued the job
    # SIGTERM reaches the ranks from Slurm and, as SIGUSR1, from the batch shell: either may be first.
    "requeued": ({"SIGTERM", "SIGUSR1"}, "SLURM has requeued this job already"),
    "torchrun": ({"SIGTERM"}, "requeued job"),
}


def _render(s: Scenario, root: Path, demo_data) -> Path:
    out = root / s.name / "job.sbatch"
    out.parent.mkdir(parents=True)
    # A time limit no run comes near, however loaded the box: its warning would be one more requeue.
    job = ["--nodes", "1", "--cpus-per-gpu", "1", "--no-exclusive", "--python", sys.executable,
           "--signal-seconds", "60", "--checkpoint-seconds", "40", "--time", "02:00:00", "--chdir", str(out.parent),
           *s.job_args]  # fmt: skip
    train = ["--model", "tiny", "--train-data", demo_data.train_pattern, "--precision", "fp32",
             "--batch-size", "32", "--workers", "2", "--warmup", "2", "--epochs", "40",
             "--max-steps", str(s.steps), "--save-every-n-steps", str(SAVE_EVERY), "--save-frequency", "0",
             "--log-every-n-steps", "8", "--local-loss", "--gather-with-grad", "--report-to", "",
             "--logs", str(root / s.name / "logs"), "--name", s.name,
             "--batch-keys-file", str(s.keys_prefix(root)), *s.train_args]  # fmt: skip
    assert slurm_main([*job, *train, "-o", str(out)]) == 0
    return out


def _by_name(name: str) -> Scenario:
    return next(s for s in SCENARIOS if s.name == name)


def _last_step(root: Path, s: Scenario) -> int:
    return max(read_keys(s.keys_prefix(root), 0), default=-1)


def _drive(cluster: SlurmCluster, root: Path, stop: threading.Event) -> None:
    """Inject each scenario's fault once it trains."""
    while not stop.wait(0.5):
        for s in SCENARIOS:
            if s.fault and not s.fault_at and _last_step(root, s) >= TRIGGER_STEP:
                s.fault(cluster, s.job_id)
                s.fault_at = time.monotonic()


def _progress(cluster: SlurmCluster, root: Path) -> tuple:
    """What moves while the jobs are alive: their states, restarts and trained steps."""
    jobs = [cluster.job(s.job_id) for s in SCENARIOS]
    return tuple((j.get("JobState"), j.get("Restarts"), file_size(Path(f"{s.keys_prefix(root)}.rank0.jsonl")))
                 for s, j in zip(SCENARIOS, jobs))  # fmt: skip


def _stop_reference(cluster: SlurmCluster, root: Path, patience: Patience) -> None:
    """Once it is ahead of every other run's last step (it never lost time to a requeue)."""
    ref = SCENARIOS[0]
    needed = max(_last_step(root, s) for s in SCENARIOS[1:])
    patience.wait(lambda: _last_step(root, ref) >= needed or cluster.job(ref.job_id).get("JobState") != "RUNNING",
                  lambda: _progress(cluster, root), what=f"the reference reaching step {needed}")  # fmt: skip
    cluster.run("scancel", str(ref.job_id), check=False)


def _final(cluster: SlurmCluster, s: Scenario) -> bool:
    return cluster.job(s.job_id).get("JobState") in FINAL


@pytest.fixture(scope="module")
def finished(module_tmp, demo_data):
    root = module_tmp("slurm")
    cluster = start_for_tests(
        lambda: SlurmCluster.start(root / "cluster"), reason=missing_reason(), what="the Slurm tests"
    )
    stop = threading.Event()
    try:
        patience = Patience(stall_limit_s(rank_start_up_s()))
        for s in SCENARIOS:
            script = _render(s, root, demo_data)
            s.job_id = cluster.sbatch(script, "-p", s.partition, cwd=script.parent)
        threading.Thread(target=_drive, args=(cluster, root, stop), daemon=True).start()
        for s in SCENARIOS[1:]:
            patience.wait(
                lambda s=s: _final(cluster, s), lambda: _progress(cluster, root), what=f"{s.name} finishing"
            )
        _stop_reference(cluster, root, patience)
        patience.wait(lambda: _final(cluster, SCENARIOS[0]), lambda: _progress(cluster, root),
                      what="the reference finishing")  # fmt: skip
        yield cluster, root
    finally:
        stop.set()
        for s in SCENARIOS:
            if s.job_id:
                cluster.run("scancel", str(s.job_id), check=False)
        cluster.stop()


def _output(root: Path, s: Scenario) -> str:
    return "".join(p.read_text(errors="replace") for p in (root / s.name).glob("*.out"))


def test_uninterrupted_run_is_not_requeued_and_a_cancelled_one_stays_cancelled(finished) -> None:
    cluster, root = finished
    ref = SCENARIOS[0]
    job, out = cluster.job(ref.job_id), _output(root, ref)
    assert job["Restarts"] == "0" and "bigclip sbatch: requeued job" not in out, out[-3000:]
    if (
        job["JobState"] == "CANCELLED"
    ):  # stopped by the test once ahead of the others: checkpointed, not requeued
        assert "so it is not requeued" in out, out[-3000:]
    else:
        assert job["JobState"] == "COMPLETED", job


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_path_requeues_and_resumes_at_the_stopped_step(finished, name: str) -> None:
    cluster, root = finished
    s = _by_name(name)
    job, out = cluster.job(s.job_id), _output(root, s)
    signals, who = EXPECTED[name]
    # every rerun at the step its predecessor stopped at (a signal: that step, no earlier periodic save)
    first = assert_requeued_and_resumed_exactly(out, job, save_every=SAVE_EVERY, final="COMPLETED")[0]
    assert first.stop["signal"] in signals and first.stop["reason"] == "preempted", first.stop
    assert first.requeued_by == who, out[-4000:]
    assert "so it is not requeued" not in out, out[-4000:]
    assert_committed(root / s.name / "logs" / s.name / "checkpoints", s.steps)
    reference = read_keys(SCENARIOS[0].keys_prefix(root), 0), read_keys(SCENARIOS[0].keys_prefix(root), 1)
    for rank in range(2):
        keys = read_keys(s.keys_prefix(root), rank)
        assert sorted(keys) == list(range(s.steps))
        assert all(keys[step] == reference[rank][step] for step in keys), f"rank {rank}: batches differ"
