"""Which failures the step watchdog calls a lost node (requeue) rather than a rank's own (fail): the
hosts each rank published in the store, against a roll call's silent ranks. Across real nodes:
tests/test_slurm_two_nodes_faults.py (killed_node)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from bigclip.train.heartbeats import Heartbeats, RollCall
from bigclip.train.watchdog import HOST_KEY, StepWatchdog

HOSTS = ["node0", "node0", "node1", "node1"]


def _watchdog(tmp_path: Path, hosts: list[str]) -> StepWatchdog:
    store = dist.HashStore()
    for rank, host in enumerate(hosts):
        store.set(f"{HOST_KEY}/{rank}", host)
    beats = Heartbeats(store, rank=0, world_size=len(HOSTS), interval_s=1.0)
    return StepWatchdog(timeout_s=15, rank=0, run_dir=tmp_path, heartbeats=beats)


def test_only_whole_silent_nodes_are_lost(tmp_path: Path) -> None:
    dog = _watchdog(tmp_path, HOSTS)
    assert dog._lost_nodes(RollCall(4, silent=[2, 3])) == ["node1"]
    assert dog._lost_nodes(RollCall(4, silent=[3])) == []  # rank 2 answers: rank 3's own failure
    assert dog._lost_nodes(RollCall(4, silent=[1, 2, 3])) == []  # rank 1 beside this rank: its own
    assert dog._lost_nodes(RollCall(4, silent=[2, 3], store_error="Broken pipe")) == []
    assert dog._lost_nodes(RollCall(4)) == []


def test_one_host_never_has_a_lost_node(tmp_path: Path) -> None:
    dog = _watchdog(tmp_path, ["box"] * 4)
    assert dog._lost_nodes(RollCall(4, silent=[1, 2, 3])) == []
