"""One rank's part of a checkpoint load: it reads the metadata of the saved ranks it overlaps.

DCP's loader has every rank read and unpickle the global `.metadata` (every saved rank's chunks:
~0.5 GB for ViT-bigG-14 saved at 1024 ranks, so ~0.4 TB of reads on one object when 768 ranks
resume) and then gathers every rank's load plan on rank 0. Here each rank works out which saved
ranks hold the parts of each tensor it needs, reads only their records (rank_record.py), checks
that their chunks cover everything it asks for, and runs DCP's own planner and reader on that
metadata alone (DCP's rank-local path, as for a checkpoint saved with use_collectives=False): at
the saving world size a rank reads its own record and rank 0's, whatever the world size.

Which saved ranks: FSDP2 and ZeRO-3 both give saved rank k the k-th equal slice of a tensor in
row-major order (FSDP2 whole rows, ZeRO-3 flat elements), so saved rank 0's chunk of a tensor
tells the slice length q, and elements [a, b) live on saved ranks a // q .. (b - 1) // q. That is
only a guess: what decides is the coverage check, and a layout it does not fit (ZeRO-1/2's flat
partitions) is read whole, every saved rank's record, with a warning.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.checkpoint.stateful import Stateful

from bigclip.checkpoint import rank_record
from bigclip.checkpoint.coordination import CheckpointGroup
from bigclip.checkpoint.integrity import CheckpointDamaged
from bigclip.checkpoint.rank_local_save import is_tensor_value
from bigclip.checkpoint.safe_load import SafeLoadPlanner
from bigclip.checkpoint.verified_reader import VerifiedReader
from bigclip.errors import StorageError
from bigclip.storage.locations import Location

log = logging.getLogger("bigclip.checkpoint")

Requested = dict[str, list[ChunkStorageMetadata] | None]  # key -> this rank's chunks (None: a value)


def requested(flat_state: dict[str, Any]) -> Requested:
    """The chunks of each tensor this rank loads into (its shards), keyed as DCP flattens them."""
    return {
        key: _create_chunk_list(value) if is_tensor_value(value) else None
        for key, value in flat_state.items()
    }


def flat_state(state: dict[str, Any]) -> dict[str, Any]:
    """`state` flattened as DCP's load planner flattens it (its keys are the checkpoint's)."""
    planner = SafeLoadPlanner()
    planner.set_up_planner(state, None, False)
    return planner.state_dict


def _span(chunk: ChunkStorageMetadata, size: Iterable[int]) -> tuple[int, int]:
    """[first, last + 1) flat row-major index of a chunk's elements (empty: (0, 0))."""
    size = list(size)
    if not size:
        return 0, 1
    if math.prod(chunk.sizes) == 0:
        return 0, 0
    strides = [math.prod(size[i + 1 :]) for i in range(len(size))]
    first = sum(o * s for o, s in zip(chunk.offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(chunk.offsets, chunk.sizes, strides))
    return first, last + 1


def _slice_length(saved: TensorStorageMetadata) -> int | None:
    """Saved rank 0's slice length of a tensor, if its chunks are one run from element 0."""
    spans = sorted(_span(c, saved.size) for c in saved.chunks if math.prod(c.sizes) > 0)
    if not spans or spans[0][0] != 0:
        return None
    end = 0
    for first, last in spans:
        if first != end:
            return None
        end = last
    return end


def ranks_to_read(wanted: Requested, rank0: Metadata, *, saved_world: int) -> set[int] | None:
    """The saved ranks whose records hold this rank's chunks, guessed from saved rank 0's
    slices (see the module docstring); None when a tensor's layout gives no guess."""
    ranks = {0}
    for key, chunks in wanted.items():
        saved = rank0.state_dict_metadata.get(key)
        if chunks is None or not isinstance(saved, TensorStorageMetadata):
            continue  # a value rank 0 wrote, or a key it lacks (the planner's key check names it)
        q = _slice_length(saved)
        if q is None:
            return None
        for chunk in chunks:
            first, end = _span(chunk, saved.size)
            if end > first:
                ranks.update(range(first // q, min(saved_world - 1, (end - 1) // q) + 1))
    return ranks


def merge(metas: list[Metadata]) -> Metadata:
    """One Metadata of several saved ranks' records (in rank order: DCP's chunk order)."""
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for meta in metas:
        for key, value in meta.state_dict_metadata.items():
            if isinstance(value, BytesStorageMetadata):
                entries.setdefault(key, value)
                continue
            mine = entries.setdefault(key, TensorStorageMetadata(value.properties, value.size, []))
            mine.chunks.extend(value.chunks)
        storage.update(meta.storage_data or {})
    first = metas[0]
    return Metadata(
        entries, planner_data=first.planner_data, storage_data=storage, storage_meta=first.storage_meta
    )


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> int:
    return math.prod(
        max(0, min(ao + an, bo + bn) - max(ao, bo))
        for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def uncovered(wanted: Requested, meta: Metadata) -> list[str]:
    """Keys whose requested chunks `meta`'s chunks do not wholly cover (saved chunks never
    overlap, so covered means the overlaps' volumes add up to the chunk's)."""
    missing = []
    for key, chunks in wanted.items():
        saved = meta.state_dict_metadata.get(key)
        if saved is None:
            continue  # not in the checkpoint at all: the planner's key check reports it
        if chunks is None:
            if MetadataIndex(key) not in (meta.storage_data or {}):
                missing.append(key)
        elif isinstance(saved, TensorStorageMetadata) and any(
            sum(_overlap(chunk, c) for c in saved.chunks) != math.prod(chunk.sizes) for chunk in chunks
        ):
            missing.append(key)
    return missing


def load_rank(
    state: dict[str, Any], reader: Any, meta: Metadata, *, rank: int, optional_keys: tuple[str, ...] = ()
) -> None:
    """Load this rank's part of `state` in place from `meta`'s chunks (no collective): DCP's
    planner and reader, as DCP's loader runs them for a rank-local checkpoint."""
    planner = SafeLoadPlanner(optional_keys=optional_keys)
    planner.set_up_planner(state, meta, rank == 0)
    reader.set_up_storage_reader(meta, rank == 0, rank=rank, use_collectives=False)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()


def load_sharded(
    state: dict[str, Any],
    location: Location,
    folder: str,
    reader: Any,
    *,
    saved_world: int,
    record_of: Callable[[int], str],
    group: CheckpointGroup,
    optional_keys: tuple[str, ...] = (),
) -> None:
    """Collective: load `state` in place from a checkpoint with rank records. Rank 0 reads saved
    rank 0's record once for everyone (every rank needs it: the replicated values and the slice
    lengths); each rank then reads the records it overlaps and its chunks, and all ranks learn
    the first failure together (a damaged chunk on one rank fails the load everywhere)."""
    rank0 = group.on_rank0(lambda: rank_record.read_metadata(location, folder, record_of(0)))
    # As dcp.load: Statefuls are loaded through their state dicts, in key order.
    plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in sorted(state.items())}
    error: BaseException | None = None
    try:
        wanted = requested(flat_state(plain))
        meta, crcs = _metadata_for(wanted, rank0, location, folder, record_of, saved_world=saved_world)
        reader = VerifiedReader(reader, uri=location.child_uri(folder), objects={}, crcs=crcs)
        load_rank(plain, reader, meta, rank=group.rank, optional_keys=optional_keys)
    except Exception as e:  # reported to every rank below
        error = e
    failures = [(rank, e) for rank, e in enumerate(group.gather(_portable(error))) if e is not None]
    _raise(group.broadcast(failures[0] if failures else None), group.world_size)
    for key, value in plain.items():
        if isinstance(state[key], Stateful):
            state[key].load_state_dict(value)
        else:
            state[key] = value


def _raise(failure: tuple[int, tuple[str, str]] | None, world: int) -> None:
    """Raise one rank's failure on every rank (named by rank when there are several)."""
    if failure is not None:
        rank, (kind, message) = failure
        prefix = f"rank {rank}: " if world > 1 else ""
        raise (CheckpointDamaged if kind == "damaged" else StorageError)(f"{prefix}{message}")


def _portable(error: BaseException | None) -> tuple[str, str] | None:
    if error is None:
        return None
    kind = "damaged" if isinstance(error, CheckpointDamaged) else "other"
    return kind, str(error) if isinstance(error, StorageError) else f"{type(error).__name__}: {error}"


def _metadata_for(
    wanted: Requested,
    rank0: tuple[Metadata, rank_record.ChunkCrcs],
    location: Location,
    folder: str,
    record_of: Callable[[int], str],
    *,
    saved_world: int,
) -> tuple[Metadata, rank_record.ChunkCrcs]:
    """The merged metadata (and chunk CRC-32s) of the saved ranks this rank needs: the guessed
    ones when their chunks cover everything it asks for, else every saved rank's (a layout the
    guess does not fit)."""
    ranks = ranks_to_read(wanted, rank0[0], saved_world=saved_world)
    if ranks is not None:
        records = [
            rank0 if k == 0 else rank_record.read_metadata(location, folder, record_of(k))
            for k in sorted(ranks)
        ]
        meta, crcs = _merged(records)
        if not uncovered(wanted, meta):
            return meta, crcs
    log.warning(
        "checkpoint %s: its chunks are not laid out in equal slices per rank (ZeRO-1/2?); this rank "
        "reads every saved rank's record (%d)",
        location.child_uri(folder),
        saved_world,
    )
    records = [
        rank0,
        *(rank_record.read_metadata(location, folder, record_of(k)) for k in range(1, saved_world)),
    ]
    return _merged(records)


def _merged(records: list[tuple[Metadata, rank_record.ChunkCrcs]]) -> tuple[Metadata, rank_record.ChunkCrcs]:
    return merge([meta for meta, _ in records]), {
        key: crc for _, crcs in records for key, crc in crcs.items()
    }
