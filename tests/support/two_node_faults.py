"""The fault driver of the two-node Slurm tests: one thread per phase watches every job's batch keys
and Slurm's Restarts count, injects each job's fault once the job has trained to its step, undoes
it once the ranks have asked for a requeue (the node comes back), and cancels the reruns that train until
stopped once they are a few steps past their resume. The reference run trains until every other
run of its phase is over and it is ahead of them all: it never lost time to a requeue.

Jobs that train until stopped cannot finish before their fault lands, however fast the box and
however late the scheduler acts (a preemptor, a time-limit warning): their steps are compared with
the reference's wherever both have one. A phase lasts as long as its jobs move (support/slurm_waits.py).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from support.launch_harness import read_keys
from support.slurm_two_nodes import TwoNodeCluster
from support.slurm_waits import Patience, file_size
from support.two_node_jobs import FINAL, keys_prefix, output

Action = Callable[[TwoNodeCluster, int], None]  # (cluster, job id)


@dataclass
class Fault:
    inject: Action
    at_step: int
    # The node comes back once the ranks have written the requeue marker (their verdict), before
    # the script requeues: Slurm's kill of the job's first run must reach the node before its rerun
    # starts there (a kill still queued for an unreachable node is delivered when it answers again,
    # and the rerun has the same job id: it would be killed).
    recover: Action | None = None  # None: the fault needs no requeue
    # Seconds each rerun is held back after a requeue (0: Slurm's own hold, cred_expire + 1 s). A node
    # that did not answer when the job was requeued gets Slurm's kill of the job once it answers, and
    # its slurmd then waits up to KillWait for the job's processes: a rerun of the same job id started
    # there meanwhile is killed with them (and its own requeue's kill can do the same to the next
    # rerun). Slurm's default hold, 120 s, outlasts KillWait; the test cluster's 10 s does not.
    rerun_hold_s: float = 0.0


@dataclass
class Job:
    name: str
    job_id: int
    fault: Fault | None = None
    cancel_after: int = 0  # steps after its resume at which the rerun is cancelled (0: it ends itself)
    fault_at: float = 0.0  # monotonic
    requeue_s: float | None = None  # seconds from the fault to Slurm's Restarts=1
    recovered: bool = False
    cancelled: bool = False
    held_restarts: int = 0  # restarts whose rerun has been held back (Fault.rerun_hold_s)


def last_step(root: Path, name: str) -> int:
    return max(read_keys(keys_prefix(root, name), 0), default=-1)


def resumed_at(root: Path, name: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed \S+ at step (\d+)", output(root, name))]


def _marked(root: Path, job: Job) -> bool:
    return (root / job.name / "logs" / job.name / f"requeue-{job.job_id}.json").exists()


def _tend(cluster: TwoNodeCluster, root: Path, job: Job) -> None:
    fault, step = job.fault, last_step(root, job.name)
    if fault and not job.fault_at and step >= fault.at_step:
        fault.inject(cluster, job.job_id)
        job.fault_at = time.monotonic()
    if fault and fault.recover and job.fault_at and not job.recovered and _marked(root, job):
        fault.recover(cluster, job.job_id)
        job.recovered = True
    timing = fault and fault.recover and job.fault_at and job.requeue_s is None
    watching = timing or (fault and fault.rerun_hold_s and job.fault_at)
    restarts = int(cluster.job(job.job_id).get("Restarts", "0")) if watching else 0
    if timing and restarts >= 1:
        job.requeue_s = round(time.monotonic() - job.fault_at, 1)
    if fault and fault.rerun_hold_s and restarts > job.held_restarts:  # still pending: its begin time moves
        hold = f"StartTime=now+{round(fault.rerun_hold_s)}"
        cluster.run("scontrol", "update", f"JobId={job.job_id}", hold, check=False)
        job.held_restarts = restarts
    resumed = resumed_at(root, job.name) if job.cancel_after and not job.cancelled else []
    if resumed and step >= resumed[0] + job.cancel_after:
        cluster.run("scancel", str(job.job_id))  # SIGTERM to every process: a checkpoint, no requeue
        job.cancelled = True


def _drive(
    cluster: TwoNodeCluster, root: Path, jobs: list[Job], stop: threading.Event, errors: list[BaseException]
) -> None:
    try:
        while not stop.wait(0.5):
            for job in jobs:
                _tend(cluster, root, job)
    except BaseException as e:  # the phase fails with it, instead of waiting for faults that never come
        errors.append(e)


def run_phase(
    cluster: TwoNodeCluster,
    root: Path,
    jobs: list[Job],
    *,
    patience: Patience,
    reference: Job | None = None,
    reference_steps: int = 0,
) -> dict[str, dict[str, str]]:
    """Drive `jobs` (and `reference`) until every one is over; their final `scontrol show job`.
    The reference is stopped once it has `reference_steps` steps and is ahead of the others."""
    stop, errors = threading.Event(), []
    everyone = jobs + [reference] * (reference is not None)
    threading.Thread(target=_drive, args=(cluster, root, everyone, stop, errors), daemon=True).start()

    def progress() -> tuple:
        return tuple((cluster.job(j.job_id).get("JobState"), cluster.job(j.job_id).get("Restarts"),
                      file_size(Path(f"{keys_prefix(root, j.name)}.rank0.jsonl"))) for j in everyone)  # fmt: skip

    def over(job: Job) -> bool:
        if (
            errors
        ):  # the fault driver failed: the phase fails with it, instead of waiting for faults that never come
            raise errors[0]
        return cluster.job(job.job_id).get("JobState") in FINAL

    try:
        for j in jobs:
            patience.wait(lambda j=j: over(j), progress, what=f"{j.name} finishing")
        if reference is not None:
            needed = max([reference_steps - 1, *(last_step(root, j.name) for j in jobs)])
            running = lambda: cluster.job(reference.job_id).get("JobState") == "RUNNING"  # noqa: E731
            patience.wait(lambda: last_step(root, reference.name) >= needed or not running(), progress,
                          what=f"the reference reaching step {needed}")  # fmt: skip
            cluster.run("scancel", str(reference.job_id), check=False)
            patience.wait(lambda: over(reference), progress, what="the reference finishing")
        return {j.name: cluster.job(j.job_id) for j in everyone}
    finally:
        stop.set()


def flap_link(i: int, *, down_s: float) -> Action:
    """A stall: node i's link down for `down_s` seconds, then up again (a timer brings it back).
    Enough without netem or a userspace relay: while the link is down the kernel drops every packet
    on it and the sockets stay open, so gloo's TCP connections stop dead exactly as behind a relay
    that stops forwarding; once it is up, TCP's retransmissions (exponential backoff: resumed
    within about twice a few-second outage) carry them on. What a relay would add, a fixed delay
    per packet, is not what the watchdog judges: it judges how long a step takes."""

    def flap(cluster: TwoNodeCluster, job_id: int) -> None:
        cluster.set_link(i, up=False)
        timer = threading.Timer(down_s, cluster.set_link, args=(i,), kwargs={"up": True})
        timer.daemon = True
        timer.start()

    return flap


def near_time_limit(*, minutes_left: int) -> Action:
    """Lower the job's time limit to `minutes_left` whole minutes past its run time so far: Slurm's
    next time-limit pass sends the `#SBATCH --signal=USR1@N` warning (N above the time left)."""

    def lower(cluster: TwoNodeCluster, job_id: int) -> None:
        run_s = _seconds(cluster.job(job_id)["RunTime"])
        cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={run_s // 60 + minutes_left}")

    return lower


def set_time_limit(minutes: int) -> Action:
    """The rerun's fresh limit (minutes from its start): far beyond it, so no second warning comes."""
    return lambda cluster, job_id: cluster.run(
        "scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}"
    )


def _seconds(run_time: str) -> int:
    days, _, hms = run_time.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s
