"""One rank's part of a checkpoint save, planned by the rank alone: no plan crosses the network.

DCP's coordinator gathers every rank's save plan (~1 MB each for ViT-bigG-14), builds and
validates a global plan on rank 0 and scatters it back: at 1024 ranks minutes of rank 0's CPU
per save, growing with the world size. Yet nothing global needs deciding here: a sharded
tensor's chunks (FSDP2's DTensors, ZeRO's fragments) belong to the rank holding them, and
every other value is replicated by DCP's contract (each rank passes the same keys, and a plain
tensor or object held by several ranks is one value). So each rank runs DCP's own planner on
its own state (`DefaultSavePlanner`, DCP's rank-local path, as `dcp.save(use_collectives=False)`
does), writes only what it owns (rank 0 the replicated values too: what DCP's deduplication
would keep once), under the storage prefix DCP would give it (`__R_`, or the S3 writer's
prefix strategy), then its record (rank_record.py: its metadata and training state), and returns
its piece of the global `.metadata` (metadata_stream.py) for the commit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from bigclip.checkpoint import metadata_stream, rank_record


@dataclass
class RankSave:
    """What one rank wrote: its piece of `.metadata`, the keys it saw, and on rank 0 the
    `.metadata` skeleton's head (every key's size and dtype). Its own metadata is in its record."""

    piece: bytes
    keys_digest: str
    head: bytes | None = None

    @property
    def piece_digest(self) -> str:
        return hashlib.sha256(self.piece).hexdigest()


def is_tensor_value(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, ShardedTensor)) or hasattr(value, "__create_write_items__")


def keys_digest(flat_state: dict[str, Any]) -> tuple[str, list[str]]:
    """A digest of every key and whether it holds a tensor (equal on every rank, or the save is
    refused), and the tensor keys in the order `.metadata`'s pieces number them."""
    kinds = sorted((key, is_tensor_value(value)) for key, value in flat_state.items())
    tensors = [key for key, is_tensor in kinds if is_tensor]
    return hashlib.sha256(repr(kinds).encode()).hexdigest(), tensors


def storage_prefix(writer: Any, rank: int) -> str:
    """The file-name prefix of a rank's objects: the S3 writer's prefix strategy's, else DCP's."""
    strategy = getattr(writer, "prefix_strategy", None)
    return strategy(rank) if strategy is not None else f"__{rank}_"


def _owned(item: WriteItem, rank: int) -> bool:
    """Whether this rank writes the item: its own shards' chunks; everything else on rank 0.
    An empty chunk holds nothing: only rank 0 records one, and only for an empty tensor."""
    if item.type != WriteItemType.SHARD:
        return rank == 0
    if math.prod(item.tensor_data.chunk.sizes) > 0:
        return True
    return rank == 0 and math.prod(item.tensor_data.size) == 0


def write_rank(state: dict[str, Any], writer: Any, *, rank: int, train: Any) -> RankSave:
    """Plan, write and record this rank's part of the checkpoint (no collective).

    `state`: plain state dicts (no Statefuls), as DCP would save them; `writer`: the location's
    DCP writer (its file system hashes every object); `train`: this rank's own training state,
    kept in its record."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=False)
    digest, tensor_keys = keys_digest(planner.state_dict)
    plan = planner.create_local_plan()
    head = _head(plan, writer, tensor_keys) if rank == 0 else None
    plan = dataclasses.replace(plan, items=[item for item in plan.items if _owned(item, rank)])
    (plan,), local = planner.create_global_plan([plan])
    prefix = storage_prefix(writer, rank)
    _make_folders(writer, prefix)
    plan = planner.finish_plan(dataclasses.replace(plan, storage_data=_StoragePrefix(prefix)))
    results = writer.write_data(plan, planner)
    results.wait()
    local.storage_data = {result.index: result.storage_data for result in results.value()}
    chunks = _chunk_crcs(writer.fs, local.storage_data.values())
    local.storage_meta = writer.storage_meta()
    local.version = CURRENT_DCP_VERSION
    path = writer.fs.concat_path(writer.path, rank_record.record_name(prefix))
    with writer.fs.create_stream(path, "wb") as stream:
        stream.write(rank_record.encode(train, local, chunks))
    piece = metadata_stream.rank_piece(local, tensor_keys)
    return RankSave(piece=piece, keys_digest=digest, head=head)


def _chunk_crcs(fs: Any, infos: Any) -> dict[str, dict[int, int]]:
    """file -> {offset: CRC-32} of the chunks just written, as the hashing file system saw them pass
    (storage/hashing.py); {} from a file system that does not keep them."""
    recorded = getattr(fs, "chunk_crcs", None)
    written: dict[str, dict[int, int]] = {}  # each file's, asked once
    chunks: dict[str, dict[int, int]] = {}
    for info in infos if recorded is not None else ():
        if info.relative_path not in written:
            written[info.relative_path] = recorded(info.relative_path)
        crc = written[info.relative_path].get(info.offset)
        if crc is not None and not info.transform_descriptors:
            chunks.setdefault(info.relative_path, {})[info.offset] = crc
    return chunks


def _head(plan: SavePlan, writer: Any, tensor_keys: list[str]) -> bytes:
    """Rank 0's head of `.metadata`, from its whole plan: every key has an item there (an empty
    chunk where rank 0 holds none of a sharded tensor), with the tensor's size and dtype."""
    _, meta = create_default_global_save_plan([plan])
    meta.planner_data, meta.storage_meta, meta.version = (
        plan.planner_data,
        writer.storage_meta(),
        CURRENT_DCP_VERSION,
    )
    head, keys = metadata_stream.skeleton(meta)
    if keys != tensor_keys:
        missing = sorted(set(tensor_keys) - set(keys))[:3]
        raise ValueError(f"rank 0's save plan has no item for tensor keys {missing}: cannot write .metadata")
    return head


def _make_folders(writer: Any, prefix: str) -> None:
    writer.fs.mkdir(writer.path)
    folder = prefix.rpartition("/")[0]
    if folder:
        writer.fs.mkdir(writer.fs.concat_path(writer.path, folder))
