"""The DeepSpeed checkpoint-state builder as it was before it became O(this rank's fragments): the
reference the new one (bigclip/engines/deepspeed_state.py `sharded`) is compared with.

Each parameter was a `ShardedTensor` whose global metadata listed every rank's boxes, from an
all-gather of every rank's ranges at build time; torch validated those boxes against each other
whenever one was built. Kept here, and only here, so a test can show that both builders give
DCP the same checkpoint (metadata and bytes) and that the old one's work grows with the world.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from bigclip.engines import deepspeed_state
from bigclip.engines.deepspeed_layout import ZeroLayout, flat_boxes

Owners = dict[str, list[tuple[int, int, int]]]  # name -> [(rank, start, numel)] over all ranks


def gather_owners(layout: ZeroLayout) -> Owners:
    """Collective: every rank's range of every parameter (the old ZeroLayout._gather_owners)."""
    mine = {n: (f.start, f.numel) for n, f in layout.local.items() if f is not None}
    world = dist.get_world_size(layout.group)
    everyone: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine, group=layout.group)
    owners: Owners = {n: [] for n in layout.params}
    for rank, ranges in enumerate(everyone):
        for name, (start, numel) in ranges.items():
            owners[name].append(
                (dist.get_global_rank(layout.group, rank) if layout.group else rank, start, numel)
            )
    return owners


def zero3_owners(layout: ZeroLayout, world: int) -> Owners:
    """What `gather_owners` returns under ZeRO-3, from DeepSpeed's rule instead of a collective
    (under torch's fake process group collectives move no data): rank r owns elements
    [r * p, min((r + 1) * p, numel)) of each parameter, p = ceil(numel / world) its partition."""
    owners: Owners = {}
    for name, param in layout.params.items():
        partition, numel = param.ds_tensor.ds_numel, param.ds_numel
        spans = ((rank, rank * partition, min(partition, numel - rank * partition)) for rank in range(world))
        owners[name] = [span for span in spans if span[2] > 0]
    return owners


def old_sharded(
    owners: Owners, layout: ZeroLayout, name: str, local: torch.Tensor | None, *, dtype: torch.dtype
) -> ShardedTensor:
    """The old builder, verbatim: a ShardedTensor of parameter `name`'s true shape over every
    rank's fragment; this rank's shards are views of `local` (its fragment, flat)."""
    shape, me = layout.shapes[name], dist.get_rank()
    device = str(local.device) if local is not None else str(layout.flats[0].device)
    boxes = {rank: flat_boxes(shape, start, start + numel) for rank, start, numel in owners[name]}
    metas, shards = [], []
    for rank in range(dist.get_world_size()):
        pos = 0
        for offsets, sizes in boxes.get(rank) or [([shape[0]] + [0] * (len(shape) - 1), [0, *shape[1:]])]:
            meta = ShardMetadata(offsets, sizes, placement=f"rank:{rank}/{device}")
            metas.append(meta)
            if rank == me:
                n = math.prod(sizes)
                data = local[pos : pos + n] if n else torch.empty(0, dtype=dtype, device=device)
                shards.append(Shard(data.view(sizes), meta))
                pos += n
    props = TensorProperties(
        dtype=dtype, requires_grad=False, pin_memory=bool(local is not None and local.is_pinned())
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metas, torch.Size(shape), props)
    )


@contextlib.contextmanager
def old_builder(owners: Owners) -> Iterator[None]:
    """Within: the engine's state classes build their entries with the old builder."""
    new = deepspeed_state.sharded
    deepspeed_state.sharded = lambda *args, **kw: old_sharded(owners, *args, **kw)
    try:
        yield
    finally:
        deepspeed_state.sharded = new


def old_state(engine: Any, owners: Owners | None = None) -> dict[str, Any]:
    """`engine.checkpoint_state()` as the old builder made it, as plain state dicts (collective
    when `owners` is not given: the old all-gather)."""
    owners = gather_owners(engine.layout) if owners is None else owners
    with old_builder(owners):
        return {key: state.state_dict() for key, state in engine.checkpoint_state().items()}
