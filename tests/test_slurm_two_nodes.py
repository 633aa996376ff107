"""The rendered sbatch scripts across two nodes of a real Slurm (two network namespaces on this box,
tests/support/slurm_two_nodes.py): `bigclip slurm --nodes 2 --gpus-per-node 2` with each launcher,
`--launcher srun` (FSDP2), `--launcher torchrun` (DeepSpeed ZeRO-3) and `--launcher deepspeed`
(DeepSpeed's own launcher on each node, ZeRO-3), 4 CPU ranks of the tiny model over gloo, each
submitted with sbatch on node0 as a user would. What crosses nodes is exercised for real: MASTER_ADDR from the
first host of SLURM_JOB_NODELIST (resolved through node0's /etc/hosts to its veth address), the
torchrun c10d rendezvous there, per-node SLURM_NODEID / local ranks, gloo between namespaces.
The losses must equal, step for step, the same script rendered for one node with 4 ranks (ZeRO-3's
to float rounding), and so must every rank's batches.
The `--launcher deepspeed` job is also preempted as Slurm does it (`scancel --signal=TERM`: SIGTERM
to every process of the steps, DeepSpeed's launchers included) once it has trained: it must
checkpoint that step, requeue and resume there, with the batches and losses of the one-node run,
so its runs together are the launcher's whole check (requeues are not counted exactly:
support/requeues.py). Each engine and each launcher runs
once across nodes (FSDP2 under torchrun is the FSDP2 of srun and the torchrun of ZeRO-3).
A fifth job keeps its logs, and so its checkpoint folder, on a node-local folder (the cluster's
`local`: one path, each node's own folder behind it, as `--logs /local-nvme/...` on a real cluster):
it must be refused within seconds, before training, naming node1 and the fix, and leave no file.
The other jobs pass the same check with a folder both nodes share. The jobs run side by side,
waited for while they move (support/slurm_waits.py). Without root, Slurm or `ip` the tests skip,
saying why; under CI they fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.launch_harness import read_keys
from support.requeues import assert_committed, assert_requeued_and_resumed_exactly
from support.slurm_waits import Patience, file_size, rank_start_up_s, stall_limit_s
from support.two_node_jobs import (
    FINAL,
    ROOT,
    keys_prefix,
    losses,
    output,
    render,
    starts,
    submit,
    two_node_cluster,
)

pytestmark = [pytest.mark.slow, pytest.mark.dist]
STEPS = 6
TWO_NODES = ["--nodes", "2", "--gpus-per-node", "2"]
JOBS = {
    "one_node": ["--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "4"],
    "srun": [*TWO_NODES, "--launcher", "srun"],
    "zero3": [*TWO_NODES, "--launcher", "torchrun"],
    "ds_preempted": [*TWO_NODES, "--launcher", "deepspeed"],
    "node_local": [*TWO_NODES, "--launcher", "srun"],
}
ZERO3 = ["--engine", "deepspeed", "--deepspeed-config", str(ROOT / "ds_configs/zero3.json")]
ENGINE = {"zero3": "deepspeed", "ds_preempted": "deepspeed"}  # else fsdp
SAVE_EVERY = 4  # two_node_jobs.render's --save-every-n-steps


def _run_all(cluster, root, ids: dict[str, int], patience: Patience) -> dict[str, dict[str, str]]:
    """Wait for every job; SIGTERM the steps of ds_preempted once its rank 0 has trained step 1."""
    preempted = False

    def over() -> bool:
        nonlocal preempted
        if not preempted and max(read_keys(keys_prefix(root, "ds_preempted"), 0), default=-1) >= 1:
            cluster.run("scancel", "--signal=TERM", str(ids["ds_preempted"]))
            preempted = True
        return all(cluster.job(job_id).get("JobState") in FINAL for job_id in ids.values())

    def progress() -> tuple:
        return tuple((cluster.job(i).get("JobState"), cluster.job(i).get("Restarts"),
                      file_size(Path(f"{keys_prefix(root, name)}.rank0.jsonl"))) for name, i in ids.items())  # fmt: skip

    patience.wait(over, progress, what="the jobs finishing")
    return {name: cluster.job(job_id) for name, job_id in ids.items()}


@pytest.fixture(scope="module")
def finished(module_tmp, demo_data):
    root = module_tmp("two_nodes")
    with two_node_cluster(root) as cluster:
        patience = Patience(stall_limit_s(rank_start_up_s()))
        ids = {}
        for name, job in JOBS.items():
            train = ZERO3 if name in ENGINE else []
            if name == "node_local":
                train = ["--logs", str(cluster.local / "logs")]
            script = render(root, name, data=demo_data.train_pattern, steps=STEPS, job=job, train=train)
            ids[name] = submit(cluster, script)
        yield root, _run_all(cluster, root, ids, patience)


@pytest.mark.parametrize("name", ["srun", "zero3", "ds_preempted"])
def test_two_node_script_trains_4_ranks_on_2_hosts_with_the_one_node_losses(finished, name: str) -> None:
    root, states = finished
    out = output(root, name)
    assert states[name]["JobState"] == "COMPLETED", f"{states[name]}\n{out[-4000:]}"
    assert states[name]["NodeList"] == "node[0-1]", states[name]
    engine = ENGINE.get(name, "fsdp")
    assert "4 ranks on 2 nodes" in out, out[-4000:]
    assert re.search(rf"run \S+: 4 rank\(s\), engine {engine}", out), out[-4000:]
    expected = {("node0", "0"), ("node1", "1")}
    assert starts(out) == expected, out[-4000:]  # each node's processes ran on that node's host
    if name == "srun":  # one process per rank: 2 on each node
        assert sorted(re.findall(r"start on (node\d) node \d procid (\d)", out)) == [
            ("node0", "0"), ("node0", "1"), ("node1", "2"), ("node1", "3")
        ]  # fmt: skip
    if name == "ds_preempted":  # one DeepSpeed launcher per node and run, each with its node rank and 2 ranks
        per_node = re.findall(r"nnodes=2, num_local_procs=2, node_rank=(\d)", out)
        runs = 1 + int(states[name]["Restarts"])
        assert sorted(per_node) == sorted(["0", "1"] * runs), out[-4000:]
    reference = losses(output(root, "one_node"))
    assert states["one_node"]["JobState"] == "COMPLETED" and len(reference) == STEPS, reference
    _same_losses_and_batches_as_one_node(root, name, out, zero3=name in ENGINE)


def _same_losses_and_batches_as_one_node(root, name: str, out: str, *, zero3: bool) -> None:
    reference = losses(output(root, "one_node"))
    if zero3:  # another engine: the same losses up to float rounding (4 decimals printed)
        assert len(losses(out)) == STEPS
        assert all(abs(float(a) - float(b)) <= 2e-3 for a, b in zip(losses(out), reference)), (
            losses(out),
            reference,
        )
    else:
        assert losses(out) == reference
    for rank in range(4):  # every rank trained every step, on the one-node run's batches
        keys = read_keys(root / name / "keys", rank)
        assert sorted(keys) == list(range(STEPS)) and keys == read_keys(root / "one_node" / "keys", rank)


def test_deepspeed_launcher_preempted_across_nodes_checkpoints_that_step_and_resumes_exactly(
    finished,
) -> None:
    root, states = finished
    out, state = output(root, "ds_preempted"), states["ds_preempted"]
    tail = out[-4000:]
    # every rerun at the stopped step itself, no earlier periodic save: the launchers let the ranks finish it
    first = assert_requeued_and_resumed_exactly(out, state, save_every=SAVE_EVERY, final="COMPLETED")[0]
    assert (first.stop["signal"], first.stop["reason"]) == ("SIGTERM", "preempted"), tail
    assert first.requeued_by == "requeued job", tail
    # DeepSpeed's launchers never acted on the SIGTERM (they log this when they do), no worker died
    assert "Main process received SIGTERM" not in out and "DataLoader worker" not in out, tail
    _same_losses_and_batches_as_one_node(root, "ds_preempted", out, zero3=True)
    assert_committed(root / "ds_preempted" / "logs" / "ds_preempted" / "checkpoints", STEPS)


def test_a_checkpoint_folder_on_a_node_local_disk_is_refused_before_training(finished) -> None:
    root, states = finished
    out, state = output(root, "node_local"), states["node_local"]
    # the ranks exit 2 (bad input); srun ends the rest of the step at the first and the job fails
    assert state["JobState"] == "FAILED", f"{state}\n{out[-4000:]}"
    assert re.search(r"tasks? [\d-]+: Exited with exit code 2", out), out[-4000:]
    assert starts(out) == {("node0", "0"), ("node1", "1")}, out[-4000:]  # both nodes' ranks ran the check
    local = root / "cluster" / "local/logs/node_local/checkpoints"
    refusal = (
        f"the checkpoint folder {local} is not shared across nodes: node1 (rank 2) does not see the file"
    )
    assert refusal in out and "an s3:// URI, with --logs or --checkpoint-dir" in out, out[-4000:]
    assert "bigclip sbatch: requeued" not in out and not read_keys(
        root / "node_local" / "keys", 0
    )  # no step ran
    for node in ("node0", "node1"):  # each node's own folder: no file left (the script's empty folders aside)
        assert not [p for p in (root / "cluster" / f"local-{node}").rglob("*") if p.is_file()], node
