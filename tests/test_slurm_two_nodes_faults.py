"""Faults across the two nodes of a real Slurm (tests/support/slurm_two_nodes.py), each ending in a
requeue and an exact resume: the batches after the resume are an uninterrupted run's. 4 CPU ranks
of the tiny model over gloo, FSDP2, the srun script, 2 data workers per rank (so on both nodes).

Phase 1, side by side, node1's link limited by a token bucket (tc tbf, SLOW_RATE):
  slow_link  trains on at the default watchdog timeouts: it completes, slower, with no hung
             verdict and no requeue. It is the uninterrupted reference for the others.
  preempted  a job of the higher-priority partition needs both nodes' GPUs: SIGTERM to the steps
             on both nodes; the ranks checkpoint the step they are at and the script requeues.
Phase 2, side by side:
  lost_node  node1's link goes down: its ranks do not fail, they stop answering. The ranks on
             node0 hang in a collective until their watchdog (--step-timeout) names ranks 2 and
             3 in a roll call and writes the requeue marker; srun still waits for node1's tasks,
             so the script stops waiting for it and requeues. The link comes back (the node
             returns), and the rerun resumes from the last committed checkpoint.
  one_node   the preempted run's final two-node checkpoint resumed on node0 alone with 2 ranks
             (--batch-size doubled to keep the global batch, as the resume asks).
The seconds from each fault to the requeue (Slurm's Restarts=1) are printed (pytest -s).
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import pytest
from support.launch_harness import read_keys
from support.slurm_two_nodes import IFACE, TwoNodeCluster
from support.two_node_jobs import keys_prefix, output, render, submit, two_node_cluster, wait_final

pytestmark = [pytest.mark.slow, pytest.mark.dist]
STEPS, TRIGGER, SAVE_EVERY = 16, 5, 4  # a fault lands between saves
SLOW_RATE = "200mbit"  # about 2x the step time of the tiny model's 4 ranks here
TWO_NODES = ["--nodes", "2", "--gpus-per-node", "0", "--ranks-per-node", "2"]
STEP_TIMEOUT_S = 15
HALF_RANKS = ["--batch-size", "32"]  # half the ranks, twice the batch: the checkpoint's global batch of 64
REQUEUE_S: dict[str, float] = {}  # fault -> seconds until Slurm counted the requeue


def _last_step(root, name: str) -> int:
    return max(read_keys(keys_prefix(root, name), 0), default=-1)


def _link(cluster: TwoNodeCluster, state: str) -> None:
    subprocess.run(["ip", "-n", cluster.nodes[1].netns, "link", "set", IFACE, state], check=True, timeout=30)


def _preempt(cluster: TwoNodeCluster) -> None:  # a higher PriorityTier job needs every GPU of both nodes
    cluster.run("sbatch", "-p", "high", "-N", "2", "--gres=gpu:2", "--output=/dev/null", "--wrap", "sleep 1")


def _cut(cluster: TwoNodeCluster) -> None:
    _link(cluster, "down")


def _drive(cluster: TwoNodeCluster, root, ids: dict[str, int], stop: threading.Event) -> None:
    """Inject each job's fault at TRIGGER; the lost node's link comes back once the job is requeued."""
    faults = {"preempted": _preempt, "lost_node": _cut}
    fault_at: dict[str, float] = {}
    while not stop.wait(0.5):
        for name in set(faults) & set(ids) - set(fault_at):
            if _last_step(root, name) >= TRIGGER:
                faults[name](cluster)
                fault_at[name] = time.monotonic()
        for name in set(fault_at) - set(REQUEUE_S):
            if int(cluster.job(ids[name]).get("Restarts", "0")) >= 1:
                REQUEUE_S[name] = round(time.monotonic() - fault_at[name], 1)
                if name == "lost_node":
                    _link(cluster, "up")


def _run_phase(cluster: TwoNodeCluster, root, ids: dict[str, int], timeout_s: float) -> dict[str, dict]:
    stop = threading.Event()
    threading.Thread(target=_drive, args=(cluster, root, ids, stop), daemon=True).start()
    try:
        return {name: wait_final(cluster, job_id, timeout_s=timeout_s) for name, job_id in ids.items()}
    finally:
        stop.set()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, demo_data):
    root = tmp_path_factory.mktemp("two_node_faults")
    data, train = demo_data.train_pattern, ["--workers", "2", "--save-every-n-steps", str(SAVE_EVERY)]

    def job(name: str, job: list[str], *extra: str, steps: int = STEPS, run: str = "") -> object:
        return render(root, name, data=data, steps=steps, job=job, train=[*train, *extra], run=run)

    with two_node_cluster(root) as cluster:
        cluster.limit_link(1, rate=SLOW_RATE)
        ids = {"slow_link": submit(cluster, job("slow_link", TWO_NODES)),
               "preempted": submit(cluster, job("preempted", ["--nodes", "2", "--gpus-per-node", "2"]), "low")}  # fmt: skip
        states = _run_phase(cluster, root, ids, timeout_s=420)
        qdisc = _qdisc(cluster)
        cluster.unlimit_link(1)
        one_node = ["--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "2"]
        ids = {"lost_node": submit(cluster, job("lost_node", TWO_NODES, "--step-timeout", str(STEP_TIMEOUT_S))),
               "one_node": cluster.sbatch(job("one_node", one_node, *HALF_RANKS, steps=STEPS + 4, run="preempted"), "-p", "batch",
                                          "-w", "node0", cwd=root / "one_node")}  # fmt: skip
        states |= _run_phase(cluster, root, ids, timeout_s=420)
        print(f"\ntwo-node faults: seconds from the fault to the requeue: {REQUEUE_S}")
        yield root, states, qdisc


def _qdisc(cluster: TwoNodeCluster) -> str:
    done = subprocess.run([*cluster.nodes[1].exec, "tc", "-s", "qdisc", "show", "dev", IFACE], capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    return done.stdout


def _stops(out: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"the ranks stopped and asked for a requeue \((\{.*\})\)", out)]


def _assert_exact_resume(root, name: str, resumed_at: int) -> None:
    out = output(root, name)
    assert re.findall(r"resumed \S+ at step (\d+)", out) == [str(resumed_at)], out[-4000:]
    assert "DataLoader worker" not in out, out[-4000:]
    for rank in range(4):
        keys, reference = (
            read_keys(keys_prefix(root, name), rank),
            read_keys(keys_prefix(root, "slow_link"), rank),
        )
        assert sorted(keys) == list(range(STEPS)) and sorted(reference) == list(range(STEPS))
        assert keys == reference, f"rank {rank}: the batches differ from the uninterrupted run's"


def test_slow_link_trains_to_the_end_with_no_hung_verdict(finished) -> None:
    root, states, qdisc = finished
    out = output(root, "slow_link")
    assert states["slow_link"]["JobState"] == "COMPLETED" and states["slow_link"]["Restarts"] == "0", out[
        -4000:
    ]
    assert "step watchdog" not in out and "bigclip sbatch: requeued" not in out, out[-4000:]
    assert "tbf" in qdisc and not re.search(r"overlimits 0 ", qdisc), qdisc  # the limit held traffic back


def test_preemption_on_both_nodes_requeues_once_and_resumes_at_the_stopped_step(finished) -> None:
    root, states, _ = finished
    out = output(root, "preempted")
    assert states["preempted"]["JobState"] == "COMPLETED" and states["preempted"]["Restarts"] == "1", out[
        -4000:
    ]
    stops = _stops(out)
    assert len(stops) == 1 and stops[0]["reason"] == "preempted" and stops[0]["signal"] == "SIGTERM", out[
        -4000:
    ]
    assert "bigclip sbatch: requeued job" in out, out[-4000:]
    _assert_exact_resume(root, "preempted", stops[0]["step"])


def test_lost_node_is_named_by_the_watchdog_and_the_job_requeues(finished) -> None:
    root, states, _ = finished
    out = output(root, "lost_node")
    assert states["lost_node"]["JobState"] == "COMPLETED" and states["lost_node"]["Restarts"] == "1", out[
        -4000:
    ]
    stops = _stops(out)
    assert len(stops) == 1 and stops[0]["reason"] == "hung", out[-4000:]
    assert stops[0]["silent_ranks"] == [2, 3] and stops[0]["by_rank"] in (0, 1), stops
    assert "not answering (stopped, frozen, dead or its node lost): ranks [2, 3]" in out, out[-4000:]
    assert "bigclip sbatch: requeued job" in out, out[-4000:]
    last_saved = stops[0]["step"] // SAVE_EVERY * SAVE_EVERY
    _assert_exact_resume(root, "lost_node", last_saved)


def test_two_node_checkpoint_resumes_on_one_node_with_2_ranks(finished) -> None:
    root, states, _ = finished
    out = output(root, "one_node")
    assert states["one_node"]["JobState"] == "COMPLETED", out[-4000:]
    assert re.findall(r"resumed \S+ at step (\d+) .*saved at (\d) rank\(s\), now (\d)", out) == [
        (str(STEPS), "4", "2")
    ]
    for rank in range(2):
        assert sorted(read_keys(keys_prefix(root, "one_node"), rank)) == list(range(STEPS, STEPS + 4))
