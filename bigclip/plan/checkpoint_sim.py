"""A rank's checkpoint metadata at any world size, from the model's parameter shapes alone.

The planner prices checkpoint coordination (the `.metadata` rank 0 assembles, each rank's
record, what a resuming rank reads) and benchmarks/scale_sim.py measures it at 64-1024 ranks,
without 1024 processes: rank r's chunks follow from how its engine splits a tensor (its plan's
`rank_chunks`: FSDP2's Shard(0) rows, ZeRO-3's flat slices as row-major boxes), and the rest of its metadata is what DCP's own
planner makes of them (`create_default_global_save_plan` over the rank's write items, which is
what the rank-local save runs). Storage records (file, offset, length) stand in for the bytes a
real save writes: each chunk's tensor bytes plus torch.save's per-record overhead, measured once.

Keys are the engines' (FSDP2 and DeepSpeed save the same layout): `model.NAME`,
`optim.optimizer.state.NAME.{exp_avg,exp_avg_sq,step}`, `optim.optimizer.param_groups.G.FIELD`
(AdamW's fields, values DCP stores as bytes).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from bigclip.engines.optimizer import MOMENTS
from bigclip.plan.engine_plan import Boxes, engine_plan

PARAM_GROUPS = 2  # bigclip's: with and without weight decay (engines/optimizer.py)


@functools.cache
def record_overhead() -> int:
    """Bytes torch.save adds around a tensor's data (one DCP chunk), measured here."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(1), buffer)
    return buffer.tell() - 4


def checkpoint_keys(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...] | None]:
    """Every key of the training state and its shape (None: a non-tensor value)."""
    keys: dict[str, tuple[int, ...] | None] = {f"model.{n}": s for n, s in shapes.items()}
    for name, shape in shapes.items():
        keys |= {f"optim.optimizer.state.{name}.{m}": shape for m in MOMENTS}
        keys[f"optim.optimizer.state.{name}.step"] = ()
    fields = [*torch.optim.AdamW([torch.zeros(1)]).param_groups[0]]  # "params" included
    keys |= {f"optim.optimizer.param_groups.{g}.{f}": None for g in range(PARAM_GROUPS) for f in fields}
    return keys


def rank_chunks(shape: tuple[int, ...], *, engine: str, world: int, rank: int) -> Boxes:
    """This rank's boxes (offsets, sizes) of a sharded tensor of `shape`, as its engine splits it."""
    boxes = engine_plan(engine).rank_chunks(shape, world=world, rank=rank)
    if boxes is None:
        raise ValueError(f"engine {engine!r} lays out no checkpoint chunks here")
    return boxes


def _write_items(
    keys: dict, *, engine: str, world: int, rank: int, dtype: torch.dtype
) -> Iterator[WriteItem]:
    props = TensorProperties(dtype=dtype)
    for key, shape in keys.items():
        if shape is None:
            if rank == 0:
                yield WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
            continue
        size = torch.Size(shape)
        if not shape or key.endswith(".step"):  # 0-dim parameters and Adam's step: replicated
            boxes, kind = ([([0] * len(shape), list(shape))] if rank == 0 else []), WriteItemType.TENSOR
        else:
            boxes, kind = rank_chunks(shape, engine=engine, world=world, rank=rank), WriteItemType.SHARD
        for offsets, sizes in boxes:
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            data = TensorWriteData(chunk=chunk, properties=props, size=size)
            yield WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=kind, tensor_data=data)


def rank_metadata(
    shapes: dict[str, tuple[int, ...]],
    *,
    engine: str,
    world: int,
    rank: int,
    dtype: torch.dtype = torch.float32,
) -> Metadata:
    """Rank `rank`'s own metadata (its chunks and storage records) as the rank-local save writes it."""
    keys = checkpoint_keys(shapes)
    items = list(_write_items(keys, engine=engine, world=world, rank=rank, dtype=dtype))
    planner_data = {key: tuple(key.split(".")) for key in keys}
    (plan,), meta = create_default_global_save_plan([SavePlan(items, planner_data=planner_data)])
    meta.planner_data = planner_data
    offset, storage = 0, {}
    for item in plan.items:
        length = record_overhead() + (
            math.prod(item.tensor_data.chunk.sizes) * dtype.itemsize if item.tensor_data else 256
        )
        storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
        offset += length
    meta.storage_data = storage
    return meta
