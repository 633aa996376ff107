"""Faults across the two nodes of a real Slurm (tests/support/slurm_two_nodes.py), each ending in a
requeue and an exact resume: the batches after the resume are an uninterrupted run's. 4 CPU ranks
of the tiny model over gloo, FSDP2, the srun script, 2 data workers per rank (so on both nodes).
The driver (support/two_node_faults.py) injects each fault once its job has trained to its step.

Phase 1, side by side, node1's link limited by a token bucket (tc tbf, SLOW_RATE):
  slow_link   the uninterrupted reference, at a --step-timeout far below the default (never
              under 300 s; STALL_TIMEOUT_S, or a rank's start-up time on this box more than the
              stall where that is longer): over the slow link, and through a stall of STALL_S
              (node1's link down, then up: gloo's TCP connections stop dead, as they would behind
              a stalled relay, and retransmissions carry them on), it never gets a hung verdict
              nor a requeue. It trains until the others are over and it is ahead of them.
  preempted   a job of the higher-priority partition needs both nodes' GPUs: SIGTERM to the steps
              on both nodes; the ranks checkpoint the step they are at and the script requeues.
  time_limit  the time-limit warning of `#SBATCH --signal=USR1@N` (bigclip slurm --signal-seconds):
              at TRIGGER the test lowers the time limit to within N, so Slurm's next time-limit
              pass sends SIGUSR1 to the steps on both nodes; checkpoint, requeue, and the rerun
              gets a fresh limit.
  preempted and time_limit train until the test cancels their reruns AFTER_RESUME steps after the
  resume: however late Slurm acts on the preemptor or the warning, they cannot end first.
Phase 2, side by side:
  lost_node   node1's link goes down: its ranks do not fail, they stop answering. The ranks on
              node0 hang in a collective until their watchdog (--step-timeout: STEP_TIMEOUT_S, or
              STEP_TIMEOUT_FACTOR x the slowest steps of phase 1 where that is longer) names ranks 2 and
              3 in a roll call and writes the requeue marker; the link comes back then (the node
              returns before the requeue: see support/two_node_faults.py), the script requeues,
              and the rerun resumes from the last committed checkpoint.
  one_node    the preempted run's final two-node checkpoint resumed on node0 alone with 2 ranks
              (--batch-size doubled to keep the global batch, as the resume asks).
Phase 3 (node1 again; it cannot share it with phase 2):
  killed_node every process of node1's namespace SIGKILLed, its slurmd included: the ranks on
              node0 see their collective fail at once, the roll call finds every rank of node1
              silent, so they requeue rather than fail. node1's slurmd is restarted once they
              have written the requeue marker (the node is back); srun still waits for the dead
              node's tasks, so the script stops waiting for it (and SIGKILLs it: left behind, it
              would cancel the rerun's step) and requeues; the rerun resumes from the last checkpoint.
Every faulted job is requeued, and every rerun resumes exactly where its predecessor left its
checkpoint, on the reference's batches, to its last committed checkpoint; requeues are not counted
exactly (support/requeues.py: a kill Slurm retries at node1 once it answers again can stop a rerun
of the same job id, and the rerun comes through that too). The waits follow the machine
(support/slurm_waits.py). The seconds from each fault to the requeue (Slurm's Restarts=1) are
printed (pytest -s).
"""

from __future__ import annotations

import re
import statistics
import subprocess
from dataclasses import dataclass

import pytest
from support.launch_harness import read_keys
from support.requeues import assert_committed, assert_requeued_and_resumed_exactly, stops
from support.slurm_cluster import KILL_WAIT_S
from support.slurm_two_nodes import GPUS_PER_NODE, IFACE, TwoNodeCluster
from support.slurm_waits import Patience, rank_start_up_s, stall_limit_s
from support.two_node_faults import Fault, Job, flap_link, near_time_limit, run_phase, set_time_limit
from support.two_node_jobs import keys_prefix, output, render, submit, two_node_cluster

from bigclip.launch.slurm import LAUNCHER_GRACE_S

pytestmark = [pytest.mark.slow, pytest.mark.dist]
STEPS, TRIGGER, SAVE_EVERY = 16, 5, 4  # a fault lands between saves
ENDLESS, AFTER_RESUME = 960, 4  # steps of the runs stopped by the test
SLOW_RATE = "200mbit"  # about 2x the step time of the tiny model's 4 ranks here
STALL_S, STALL_STEP, STALL_TIMEOUT_S = 4, 3, 45
TWO_NODES = ["--nodes", "2", "--gpus-per-node", "0", "--ranks-per-node", "2"]
STEP_TIMEOUT_S, STEP_TIMEOUT_FACTOR = (
    15,
    4,
)  # the lost-node watchdog: at least this, or 4x phase 1's slow steps
HALF_RANKS = ["--batch-size", "32"]  # half the ranks, twice the batch: the checkpoint's global batch of 64
WARNING_S = 180  # time_limit's --signal-seconds: the test leaves it 2 to 3 minutes


def _cut(cluster: TwoNodeCluster, job_id: int) -> None:
    cluster.set_link(1, up=False)


def _reconnect(cluster: TwoNodeCluster, job_id: int) -> None:
    cluster.set_link(1, up=True)


def _preempt(cluster: TwoNodeCluster, job_id: int) -> None:  # a higher PriorityTier job needs every GPU
    every_gpu = f"--gres=gpu:{GPUS_PER_NODE}"
    cluster.run("sbatch", "-p", "high", "-N", "2", every_gpu, "--output=/dev/null", "--wrap", "sleep 1")


def _kill_node1(cluster: TwoNodeCluster, job_id: int) -> None:
    cluster.kill_node(1)


def _restart_node1(cluster: TwoNodeCluster, job_id: int) -> None:
    cluster.start_slurmd(1)  # ReturnToService=2: the node takes jobs again as soon as it registers


@dataclass(frozen=True)
class Limits:
    """The waits of this run, from the machine: a rank's start-up time, then phase 1's step times."""

    start_up_s: float
    stall_timeout_s: int  # slow_link's --step-timeout: the stall plus a start-up, at least STALL_TIMEOUT_S
    patience: Patience

    @classmethod
    def measure(cls) -> Limits:
        start_up = rank_start_up_s()
        stall_timeout = max(STALL_TIMEOUT_S, round(STALL_S + start_up))
        return cls(start_up, stall_timeout, Patience(stall_limit_s(start_up, extra_s=stall_timeout)))

    def step_timeout_s(self, phase1: list[str]) -> int:
        """The lost-node jobs' --step-timeout: STEP_TIMEOUT_FACTOR x the slow steps (90th percentile)
        phase 1 logged over the slowed link, at least STEP_TIMEOUT_S: a step of this box's must not
        be taken for a hang, the cut link must."""
        steps = sorted(float(t) for out in phase1 for t in re.findall(r"Batch \(t\): ([\d.]+)", out))
        slow = statistics.quantiles(steps, n=10)[-1] if len(steps) >= 10 else self.start_up_s
        return max(STEP_TIMEOUT_S, round(STEP_TIMEOUT_FACTOR * slow))


@pytest.fixture(scope="module")
def finished(module_tmp, demo_data):
    root = module_tmp("two_node_faults")
    data, train = demo_data.train_pattern, ["--workers", "2", "--save-every-n-steps", str(SAVE_EVERY)]

    def job(name: str, job: list[str], *extra: str, steps: int = STEPS, run: str = "") -> object:
        return render(root, name, data=data, steps=steps, job=job, train=[*train, *extra], run=run)

    with two_node_cluster(root) as cluster:
        limits = Limits.measure()
        cluster.limit_link(1, rate=SLOW_RATE)
        slow_link = job("slow_link", TWO_NODES, "--step-timeout", str(limits.stall_timeout_s), steps=ENDLESS)
        ref = Job("slow_link", submit(cluster, slow_link), Fault(flap_link(1, down_s=STALL_S), STALL_STEP))
        time_limit = [*TWO_NODES, "--signal-seconds", str(WARNING_S)]
        jobs = [Job("preempted", submit(cluster, job("preempted", ["--nodes", "2", "--gpus-per-node", "2"],
                                                     steps=ENDLESS), "low"),
                    Fault(_preempt, TRIGGER, recover=lambda c, j: None), cancel_after=AFTER_RESUME),
                Job("time_limit", submit(cluster, job("time_limit", time_limit, steps=ENDLESS)),
                    Fault(near_time_limit(minutes_left=3), TRIGGER, recover=set_time_limit(120)),
                    cancel_after=AFTER_RESUME)]  # fmt: skip
        states = run_phase(
            cluster, root, jobs, patience=limits.patience, reference=ref, reference_steps=STEPS
        )
        qdisc = _qdisc(cluster)
        cluster.unlimit_link(1)
        final = stops(output(root, "preempted"))[-1]["step"]  # its last checkpoint: the cancelled rerun's
        one_node = ["--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "2"]
        step_timeout = limits.step_timeout_s([output(root, j.name) for j in [ref, *jobs]])
        lost = [*TWO_NODES, "--step-timeout", str(step_timeout)]
        patience = Patience(stall_limit_s(limits.start_up_s, extra_s=step_timeout + LAUNCHER_GRACE_S))
        one = job("one_node", one_node, *HALF_RANKS, steps=final + 4, run="preempted")
        cut = Fault(_cut, TRIGGER, _reconnect, rerun_hold_s=KILL_WAIT_S + 10)  # node1 was away at the requeue
        jobs2 = [Job("lost_node", submit(cluster, job("lost_node", lost)), cut),
                 Job("one_node", cluster.sbatch(one, "-p", "batch", "-w", "node0", cwd=one.parent))]  # fmt: skip
        states |= run_phase(cluster, root, jobs2, patience=patience)
        jobs3 = [Job("killed_node", submit(cluster, job("killed_node", lost)),
                     Fault(_kill_node1, TRIGGER, _restart_node1))]  # fmt: skip
        states |= run_phase(cluster, root, jobs3, patience=patience)
        requeue_s = {j.name: j.requeue_s for j in jobs + jobs2 + jobs3 if j.requeue_s is not None}
        print(f"\ntwo-node faults: seconds from the fault to the requeue: {requeue_s}; {limits}, "
              f"lost-node step timeout {step_timeout} s")  # fmt: skip
        # the watchdog's limit (or at once: a failed collective), its roll call, the script's grace, a margin
        requeue_bound = step_timeout + LAUNCHER_GRACE_S + max(30, limits.start_up_s)
        yield root, states, qdisc, final, requeue_s, requeue_bound


def _qdisc(cluster: TwoNodeCluster) -> str:
    done = subprocess.run([*cluster.nodes[1].exec, "tc", "-s", "qdisc", "show", "dev", IFACE], capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    return done.stdout


def _assert_exact_resume(root, name: str, state: dict, *, final: str, length: int = STEPS) -> list:
    """Requeued (at least once); every rerun resumed where the run before it left its checkpoint;
    every step of every rank on the reference's batches; the last checkpoint committed."""
    out = output(root, name)
    every = assert_requeued_and_resumed_exactly(out, state, save_every=SAVE_EVERY, final=final)
    for rank in range(4):
        keys, reference = (
            read_keys(keys_prefix(root, name), rank),
            read_keys(keys_prefix(root, "slow_link"), rank),
        )
        assert sorted(keys) == list(range(len(keys))) and len(keys) >= length, (rank, sorted(keys))
        assert set(keys) <= set(reference), f"rank {rank}: the reference stopped before step {max(keys)}"
        assert all(keys[s] == reference[s] for s in keys), (
            f"rank {rank}: the batches differ from the uninterrupted run's"
        )
    last = (
        every[-1].stop["step"] if final == "CANCELLED" else length
    )  # a cancelled run checkpoints where it stops
    assert_committed(root / name / "logs" / name / "checkpoints", last, newer_allowed=True)
    return every


def test_slow_link_and_a_stall_below_the_step_timeout_give_no_hung_verdict(finished) -> None:
    root, states, qdisc, *_ = finished
    out = output(root, "slow_link")
    state = states["slow_link"]
    # stopped by the test once ahead of the others: checkpointed, not requeued
    assert state["JobState"] == "CANCELLED" and state["Restarts"] == "0", f"{state}\n{out[-4000:]}"
    assert "so it is not requeued" in out, out[-4000:]
    assert "step watchdog" not in out and "bigclip sbatch: requeued" not in out, out[-4000:]
    assert "tbf" in qdisc and not re.search(r"overlimits 0 ", qdisc), qdisc  # the limit held traffic back
    assert len(read_keys(keys_prefix(root, "slow_link"), 0)) >= STEPS
    step_s = [float(t) for t in re.findall(r"Batch \(t\): ([\d.]+)", out)]
    assert max(step_s) >= STALL_S, step_s  # the stall held a step up


@pytest.mark.parametrize("name, signal", [("preempted", "SIGTERM"), ("time_limit", "SIGUSR1")])
def test_preemption_and_time_limit_on_both_nodes_requeue_and_resume_at_the_stopped_step(
    finished, name: str, signal: str
) -> None:
    root, states, *_ = finished
    out = output(root, name)
    first_stop = stops(out)[0]
    every = _assert_exact_resume(
        root, name, states[name], final="CANCELLED", length=first_stop["step"] + AFTER_RESUME
    )
    assert first_stop["reason"] == "preempted" and first_stop["signal"] == signal, first_stop
    assert every[0].requeued_by == "requeued job", out[-4000:]  # by the script, once the ranks asked
    # the test cancelled the last rerun: it checkpointed and was not requeued
    assert every[-1].stop is not None and "so it is not requeued" in every[-1].text, out[-4000:]


@pytest.mark.parametrize("name", ["lost_node", "killed_node"])
def test_lost_node_is_named_by_the_watchdog_and_the_job_requeues(finished, name: str) -> None:
    root, states, _, _, requeue_s, requeue_bound = finished
    out = output(root, name)
    first = _assert_exact_resume(root, name, states[name], final="COMPLETED")[0]  # at the last periodic save
    reason = {"lost_node": "hung", "killed_node": "lost_node"}[name]
    assert first.stop["reason"] == reason and first.stop["silent_ranks"] == [2, 3], first.stop
    assert first.stop["by_rank"] in (0, 1), first.stop
    assert "not answering (stopped, frozen, dead or its node lost): ranks [2, 3]" in first.text, out[-4000:]
    assert requeue_s[name] < requeue_bound, (requeue_s, requeue_bound)


def test_two_node_checkpoint_resumes_on_one_node_with_2_ranks(finished) -> None:
    root, states, _, final, *_ = finished
    out = output(root, "one_node")
    assert states["one_node"]["JobState"] == "COMPLETED", out[-4000:]
    assert re.findall(r"resumed \S+ at step (\d+) .*saved at (\d) rank\(s\), now (\d)", out) == [
        (str(final), "4", "2")
    ]
    for rank in range(2):
        assert sorted(read_keys(keys_prefix(root, "one_node"), rank)) == list(range(final, final + 4))
