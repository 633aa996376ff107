"""Faults across the two nodes of a real Slurm (tests/support/slurm_two_nodes.py), each ending in a
requeue and an exact resume: the batches after the resume are an uninterrupted run's. 4 CPU ranks
of the tiny model over gloo, FSDP2, the srun script, 2 data workers per rank (so on both nodes).
The driver (support/two_node_faults.py) injects each fault once its job has trained to its step.

Phase 1, side by side, node1's link limited by a token bucket (tc tbf, SLOW_RATE):
  slow_link   the uninterrupted reference, at a --step-timeout (STALL_TIMEOUT_S) far below the
              default (never under 300 s): over the slow link, and through a stall of STALL_S
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
              node0 hang in a collective until their watchdog (--step-timeout) names ranks 2 and
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
The seconds from each fault to the requeue (Slurm's Restarts=1) are printed (pytest -s).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from support.launch_harness import read_keys
from support.slurm_two_nodes import IFACE, TwoNodeCluster
from support.two_node_faults import Fault, Job, flap_link, near_time_limit, run_phase, set_time_limit
from support.two_node_jobs import keys_prefix, output, render, submit, two_node_cluster

from bigclip.launch.slurm import LAUNCHER_GRACE_S

pytestmark = [pytest.mark.slow, pytest.mark.dist]
STEPS, TRIGGER, SAVE_EVERY = 16, 5, 4  # a fault lands between saves
ENDLESS, AFTER_RESUME = 960, 4  # steps of the runs stopped by the test
SLOW_RATE = "200mbit"  # about 2x the step time of the tiny model's 4 ranks here
STALL_S, STALL_STEP, STALL_TIMEOUT_S = 4, 3, 45
TWO_NODES = ["--nodes", "2", "--gpus-per-node", "0", "--ranks-per-node", "2"]
STEP_TIMEOUT_S = 15
HALF_RANKS = ["--batch-size", "32"]  # half the ranks, twice the batch: the checkpoint's global batch of 64
WARNING_S = 180  # time_limit's --signal-seconds: the test leaves it 2 to 3 minutes


def _cut(cluster: TwoNodeCluster, job_id: int) -> None:
    cluster.set_link(1, up=False)


def _reconnect(cluster: TwoNodeCluster, job_id: int) -> None:
    cluster.set_link(1, up=True)


def _preempt(cluster: TwoNodeCluster, job_id: int) -> None:  # a higher PriorityTier job needs every GPU
    cluster.run("sbatch", "-p", "high", "-N", "2", "--gres=gpu:2", "--output=/dev/null", "--wrap", "sleep 1")


def _kill_node1(cluster: TwoNodeCluster, job_id: int) -> None:
    cluster.kill_node(1)


def _restart_node1(cluster: TwoNodeCluster, job_id: int) -> None:
    cluster.start_slurmd(1)  # ReturnToService=2: the node takes jobs again as soon as it registers


@pytest.fixture(scope="module")
def finished(tmp_path_factory, demo_data):
    root = tmp_path_factory.mktemp("two_node_faults")
    data, train = demo_data.train_pattern, ["--workers", "2", "--save-every-n-steps", str(SAVE_EVERY)]

    def job(name: str, job: list[str], *extra: str, steps: int = STEPS, run: str = "") -> object:
        return render(root, name, data=data, steps=steps, job=job, train=[*train, *extra], run=run)

    with two_node_cluster(root) as cluster:
        cluster.limit_link(1, rate=SLOW_RATE)
        ref = Job(
            "slow_link",
            submit(
                cluster, job("slow_link", TWO_NODES, "--step-timeout", str(STALL_TIMEOUT_S), steps=ENDLESS)
            ),
            Fault(flap_link(1, down_s=STALL_S), STALL_STEP),
        )
        time_limit = [*TWO_NODES, "--signal-seconds", str(WARNING_S)]
        jobs = [Job("preempted", submit(cluster, job("preempted", ["--nodes", "2", "--gpus-per-node", "2"],
                                                     steps=ENDLESS), "low"),
                    Fault(_preempt, TRIGGER, recover=lambda c, j: None), cancel_after=AFTER_RESUME),
                Job("time_limit", submit(cluster, job("time_limit", time_limit, steps=ENDLESS)),
                    Fault(near_time_limit(minutes_left=3), TRIGGER, recover=set_time_limit(10)),
                    cancel_after=AFTER_RESUME)]  # fmt: skip
        states = run_phase(cluster, root, jobs, timeout_s=480, reference=ref, reference_steps=STEPS)
        qdisc = _qdisc(cluster)
        cluster.unlimit_link(1)
        final = _stops(output(root, "preempted"))[-1]["step"]  # its last checkpoint: the cancelled rerun's
        one_node = ["--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "2"]
        lost = [*TWO_NODES, "--step-timeout", str(STEP_TIMEOUT_S)]
        one = job("one_node", one_node, *HALF_RANKS, steps=final + 4, run="preempted")
        jobs2 = [Job("lost_node", submit(cluster, job("lost_node", lost)), Fault(_cut, TRIGGER, _reconnect)),
                 Job("one_node", cluster.sbatch(one, "-p", "batch", "-w", "node0", cwd=one.parent))]  # fmt: skip
        states |= run_phase(cluster, root, jobs2, timeout_s=420)
        jobs3 = [Job("killed_node", submit(cluster, job("killed_node", lost)),
                     Fault(_kill_node1, TRIGGER, _restart_node1))]  # fmt: skip
        states |= run_phase(cluster, root, jobs3, timeout_s=420)
        requeue_s = {j.name: j.requeue_s for j in jobs + jobs2 + jobs3 if j.requeue_s is not None}
        print(f"\ntwo-node faults: seconds from the fault to the requeue: {requeue_s}")
        yield root, states, qdisc, final, requeue_s


def _qdisc(cluster: TwoNodeCluster) -> str:
    done = subprocess.run([*cluster.nodes[1].exec, "tc", "-s", "qdisc", "show", "dev", IFACE], capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    return done.stdout


def _stops(out: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"the ranks stopped and asked for a requeue \((\{.*\})\)", out)]


def _assert_exact_resume(root, name: str, resumed_at: int, *, length: int = STEPS) -> None:
    """One resume, at `resumed_at`; every step of every rank on the reference's batches."""
    out = output(root, name)
    assert re.findall(r"resumed \S+ at step (\d+)", out) == [str(resumed_at)], out[-4000:]
    assert "DataLoader worker" not in out, out[-4000:]
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


def _assert_requeued_once(states: dict, root, name: str, *, cancelled_after: bool = False) -> list[dict]:
    """Requeued once by the script; a rerun the test cancelled checkpoints once more, not requeued."""
    out = output(root, name)
    state = states[name]
    assert state["JobState"] == ("CANCELLED" if cancelled_after else "COMPLETED"), f"{state}\n{out[-4000:]}"
    assert state["Restarts"] == "1", f"{state}\n{out[-4000:]}"
    assert out.count("bigclip sbatch: requeued job") == 1, out[-4000:]
    assert out.count("so it is not requeued") == cancelled_after, out[-4000:]
    stops = _stops(out)
    assert len(stops) == 1 + cancelled_after, out[-4000:]
    return stops


def test_slow_link_and_a_stall_below_the_step_timeout_give_no_hung_verdict(finished) -> None:
    root, states, qdisc, _, _ = finished
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
def test_preemption_and_time_limit_on_both_nodes_requeue_once_and_resume_at_the_stopped_step(
    finished, name: str, signal: str
) -> None:
    root, states, _, _, requeue_s = finished
    stops = _assert_requeued_once(states, root, name, cancelled_after=True)
    assert stops[0]["reason"] == "preempted" and stops[0]["signal"] == signal, stops
    _assert_exact_resume(root, name, stops[0]["step"], length=stops[0]["step"] + AFTER_RESUME)


@pytest.mark.parametrize("name", ["lost_node", "killed_node"])
def test_lost_node_is_named_by_the_watchdog_and_the_job_requeues(finished, name: str) -> None:
    root, states, _, _, requeue_s = finished
    out = output(root, name)
    stops = _assert_requeued_once(states, root, name)
    reason = {"lost_node": "hung", "killed_node": "lost_node"}[name]
    assert stops[0]["reason"] == reason and stops[0]["silent_ranks"] == [2, 3], stops
    assert stops[0]["by_rank"] in (0, 1), stops
    assert "not answering (stopped, frozen, dead or its node lost): ranks [2, 3]" in out, out[-4000:]
    # the watchdog's limit (or at once: a failed collective), its roll call, the script's grace
    assert requeue_s[name] < STEP_TIMEOUT_S + LAUNCHER_GRACE_S + 30, requeue_s
    last_saved = stops[0]["step"] // SAVE_EVERY * SAVE_EVERY
    _assert_exact_resume(root, name, last_saved)


def test_two_node_checkpoint_resumes_on_one_node_with_2_ranks(finished) -> None:
    root, states, _, final, _ = finished
    out = output(root, "one_node")
    assert states["one_node"]["JobState"] == "COMPLETED", out[-4000:]
    assert re.findall(r"resumed \S+ at step (\d+) .*saved at (\d) rank\(s\), now (\d)", out) == [
        (str(final), "4", "2")
    ]
    for rank in range(2):
        assert sorted(read_keys(keys_prefix(root, "one_node"), rank)) == list(range(final, final + 4))
