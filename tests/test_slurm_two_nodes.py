"""The rendered sbatch scripts across two nodes of a real Slurm (two network namespaces on this box,
tests/support/slurm_two_nodes.py): `bigclip slurm --nodes 2 --gpus-per-node 2` with `--launcher srun`
and `--launcher torchrun` (FSDP2, and torchrun with DeepSpeed ZeRO-3), 4 CPU ranks of the tiny
model over gloo, each submitted with sbatch on node0 as a user would. What crosses nodes is exercised for real: MASTER_ADDR from the
first host of SLURM_JOB_NODELIST (resolved through node0's /etc/hosts to its veth address), the
torchrun c10d rendezvous there, per-node SLURM_NODEID / local ranks, gloo between namespaces.
The losses must equal, step for step, the same script rendered for one node with 4 ranks (ZeRO-3's
to float rounding), and so must every rank's batches.
The four jobs run side by side. Without root, Slurm or `ip` the tests skip, saying why; under CI they fail.
"""

from __future__ import annotations

import re

import pytest
from support.launch_harness import read_keys
from support.two_node_jobs import ROOT, losses, output, render, starts, submit, two_node_cluster, wait_final

pytestmark = [pytest.mark.slow, pytest.mark.dist]
STEPS = 6
TWO_NODES = ["--nodes", "2", "--gpus-per-node", "2"]
JOBS = {
    "one_node": ["--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "4"],
    "srun": [*TWO_NODES, "--launcher", "srun"],
    "torchrun": [*TWO_NODES, "--launcher", "torchrun"],
    "zero3": [*TWO_NODES, "--launcher", "torchrun"],
}
ZERO3 = ["--engine", "deepspeed", "--deepspeed-config", str(ROOT / "ds_configs/zero3.json")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, demo_data):
    root = tmp_path_factory.mktemp("two_nodes")
    with two_node_cluster(root) as cluster:
        ids = {}
        for name, job in JOBS.items():
            train = ZERO3 if name == "zero3" else []
            script = render(root, name, data=demo_data.train_pattern, steps=STEPS, job=job, train=train)
            ids[name] = submit(cluster, script)
        states = {name: wait_final(cluster, job_id, timeout_s=420) for name, job_id in ids.items()}
        yield root, states


@pytest.mark.parametrize("name", ["srun", "torchrun", "zero3"])
def test_two_node_script_trains_4_ranks_on_2_hosts_with_the_one_node_losses(finished, name: str) -> None:
    root, states = finished
    out = output(root, name)
    assert states[name]["JobState"] == "COMPLETED", f"{states[name]}\n{out[-4000:]}"
    assert states[name]["NodeList"] == "node[0-1]", states[name]
    engine = "deepspeed" if name == "zero3" else "fsdp"
    assert "4 ranks on 2 nodes" in out, out[-4000:]
    assert re.search(rf"run \S+: 4 rank\(s\), engine {engine}", out), out[-4000:]
    expected = {("node0", "0"), ("node1", "1")}
    assert starts(out) == expected, out[-4000:]  # each node's processes ran on that node's host
    if name == "srun":  # one process per rank: 2 on each node
        assert sorted(re.findall(r"start on (node\d) node \d procid (\d)", out)) == [
            ("node0", "0"), ("node0", "1"), ("node1", "2"), ("node1", "3")
        ]  # fmt: skip
    reference = losses(output(root, "one_node"))
    assert states["one_node"]["JobState"] == "COMPLETED" and len(reference) == STEPS, reference
    if name == "zero3":  # another engine: the same losses up to float rounding (4 decimals printed)
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
