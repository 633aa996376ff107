"""Scripts rendered by `bigclip slurm`, run by a real Slurm (Debian's slurm-wlm 22.05 + munge, one
node, tests/support/slurm_cluster.py) on 2 CPU ranks of the tiny model with 2 data workers each.

Each path ends in exactly one requeue, and the rerun resumes at the step the job was stopped at
(not an earlier periodic checkpoint) with the batches of an uninterrupted run:
  (a) `scontrol requeue` (SIGTERM to every process; Slurm requeues), srun, GPU count without GRES;
  (b) SIGTERM to the steps (`scancel --signal=TERM`, what preemption sends), torchrun, ZeRO-3.
Partition preemption and the time-limit warning (`#SBATCH --signal=USR1@S`) take the same path
through the script on two nodes in tests/test_slurm_two_nodes_faults.py (one cluster run covers
both; running them here again doubled this file's time for no path of its own).
The uninterrupted reference trains until the test cancels it, once it is ahead of both (so no
assertion depends on how fast the box is): a cancelled job checkpoints and stays cancelled.
All three jobs run at once; a driver thread injects each fault.
Without root or Slurm the tests skip with the reason; with CI set they fail instead.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.launch_harness import read_keys
from support.slurm_cluster import SlurmCluster, missing_reason, start_for_tests

from bigclip.launch.slurm import main as slurm_main

pytestmark = [pytest.mark.slow, pytest.mark.dist]
ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 420  # for everything: the three jobs run side by side
TRIGGER_STEP = 5
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
    job = ["--nodes", "1", "--cpus-per-gpu", "1", "--no-exclusive", "--python", sys.executable,
           "--signal-seconds", "60", "--checkpoint-seconds", "40", "--time", "00:10:00", "--chdir", str(out.parent),
           *s.job_args]  # fmt: skip
    train = ["--model", "tiny", "--train-data", demo_data.train_pattern, "--precision", "fp32",
             "--batch-size", "32", "--workers", "2", "--warmup", "2", "--epochs", "40",
             "--max-steps", str(s.steps), "--save-every-n-steps", "8", "--save-frequency", "0",
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


def _stop_reference(cluster: SlurmCluster, root: Path, deadline: float) -> None:
    """Once it is ahead of every other run's last step (it never lost time to a requeue)."""
    ref = SCENARIOS[0]
    needed = max(_last_step(root, s) for s in SCENARIOS[1:])
    while _last_step(root, ref) < needed and cluster.job(ref.job_id).get("JobState") == "RUNNING":
        assert time.monotonic() < deadline, "the reference run fell behind"
        time.sleep(1)
    cluster.run("scancel", str(ref.job_id), check=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, demo_data):
    root = tmp_path_factory.mktemp("slurm")
    cluster = start_for_tests(
        lambda: SlurmCluster.start(root / "cluster"), reason=missing_reason(), what="the Slurm tests"
    )
    stop = threading.Event()
    try:
        for s in SCENARIOS:
            script = _render(s, root, demo_data)
            s.job_id = cluster.sbatch(script, "-p", s.partition, cwd=script.parent)
        threading.Thread(target=_drive, args=(cluster, root, stop), daemon=True).start()
        deadline = time.monotonic() + DEADLINE_S
        for s in SCENARIOS[1:]:
            cluster.wait_for(s.job_id, lambda j: j.get("JobState") in FINAL, what="finishing",
                             timeout_s=max(1, deadline - time.monotonic()))  # fmt: skip
        _stop_reference(cluster, root, deadline)
        cluster.wait_for(
            SCENARIOS[0].job_id, lambda j: j.get("JobState") in FINAL, what="finishing", timeout_s=90
        )
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
def test_each_path_requeues_once_and_resumes_at_the_stopped_step(finished, name: str) -> None:
    cluster, root = finished
    s = _by_name(name)
    job, out = cluster.job(s.job_id), _output(root, s)
    signals, who = EXPECTED[name]
    assert job["JobState"] == "COMPLETED", f"{job}\n{out[-4000:]}"
    assert job["Restarts"] == "1", f"{job}\n{out[-4000:]}"
    stops = [
        json.loads(m) for m in re.findall(r"the ranks stopped and asked for a requeue \((\{.*\})\)", out)
    ]
    assert len(stops) == 1, out[-4000:]
    assert stops[0]["signal"] in signals and stops[0]["reason"] == "preempted", stops
    requeues = re.findall(r"bigclip sbatch: (requeued job|SLURM has requeued this job already)", out)
    assert requeues == [who], out[-4000:]
    assert "so it is not requeued" not in out, out[-4000:]
    resumed = re.findall(r"resumed \S+ at step (\d+)", out)
    assert resumed == [str(stops[0]["step"])], out[-4000:]  # the preempted step, no earlier periodic save
    assert "DataLoader worker" not in out
    reference = read_keys(SCENARIOS[0].keys_prefix(root), 0), read_keys(SCENARIOS[0].keys_prefix(root), 1)
    for rank in range(2):
        keys = read_keys(s.keys_prefix(root), rank)
        assert sorted(keys) == list(range(s.steps))
        assert all(keys[step] == reference[rank][step] for step in keys), f"rank {rank}: batches differ"
