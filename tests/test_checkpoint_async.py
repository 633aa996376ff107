"""Async save across ranks: training goes on (and talks over its own group) while it uploads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from bigclip.checkpoint import CheckpointStore
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn


def sharded_state(world: int, seed: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    weights = {
        f"w{i}": distribute_tensor(torch.randn(96, 40, generator=g), mesh, [Shard(0)]) for i in range(4)
    }
    return {"model": weights, "train": {"step": seed}}


def local_copies(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in state["model"].items()}


def _train_while_saving(rank: int, world: int, root: str) -> dict:
    store = CheckpointStore(root)
    store.check_access()  # collective: rank 0 (LOCAL_RANK 0) probes, every rank learns the outcome
    state = sharded_state(world, seed=1)
    snapshot = local_copies(state)
    pending = store.async_save(state, step=1, meta={"model": "toy"})
    for _ in range(20):  # "training": in-place updates and collectives on the default group
        for tensor in state["model"].values():
            tensor.to_local().add_(1.0)
        dist.all_reduce(torch.ones(1000))
    uri = pending.wait()
    restored = sharded_state(world, seed=99)
    manifest = store.load(restored, "latest")
    snapshot_restored = all(torch.equal(restored["model"][k].to_local(), v) for k, v in snapshot.items())
    second = store.async_save(state, step=2)
    third = store.async_save(state, step=3)  # must first wait for the second
    ok = {
        "uri": uri,
        "snapshot_restored": snapshot_restored,
        "train_step": restored["train"]["step"],
        "world_size": manifest.world_size,
        "blocked_s": pending.blocked_s,
        "second_done_before_third_returned": second.done() and second.error is None,
        "third": third.wait(),
    }
    store.close()
    return ok


@pytest.mark.dist
def test_async_save_commits_the_staged_snapshot_while_training_continues():
    with LoopbackS3() as s3:
        root = s3.create_bucket("async-save") + "/run"
        results = spawn(_train_while_saving, 2, root)
    for result in results:
        assert result["uri"] == f"{root}/step_00000001"
        assert result["snapshot_restored"], "the checkpoint holds updates made after async_save returned"
        assert result["train_step"] == 1 and result["world_size"] == 2
        assert result["blocked_s"] >= 0
        assert result["second_done_before_third_returned"]
        assert result["third"] == f"{root}/step_00000003"
