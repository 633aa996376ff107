"""Writing a stream of tensor pieces as safetensors: one file, or shards with an index.

The layout is planned before any data moves: output names, dtypes and shapes are known from
the source's metadata, so each file's header is written first and the tensors' bytes follow
as they stream in, converted piece by piece. The index and the checksum manifest (the commit
marker) are written next, still under temporary names, so a disk that fills fails before anything
is committed; then the files, the index and the manifest are committed in that order (a commit
that fails deletes those before it). An interrupted write leaves temporary files (locally; the
next consolidate to the same output removes them) or aborted uploads (S3), never a file under its
final name without its manifest.

Naming follows Hugging Face: OUT ending in `.safetensors` is the file (shards and index go
beside it as STEM-00001-of-0000N.safetensors and STEM.safetensors.index.json); any other OUT
is a folder receiving model.safetensors (or model-0000i-of-0000N.safetensors + index).
"""

from __future__ import annotations

import datetime
import json
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from bigclip.errors import StorageError
from bigclip.storage.locations import LocalLocation, Location, open_location
from bigclip.storage.records import ObjectRecord
from bigclip.storage.sinks import Sink
from bigclip.weights.dcp_reader import TensorInfo
from bigclip.weights.safetensors_format import INDEX_SUFFIX, encode_header

log = logging.getLogger("bigclip.consolidate")
MANIFEST_SUFFIX = ".manifest.json"
FORMAT = "bigclip-consolidated"


@dataclass
class OutputPlan:
    """Which tensors go into which file, under which folder."""

    folder: str  # a local folder or s3:// prefix
    stem: str
    files: list[tuple[str, list[TensorInfo]]]
    index: str | None  # the index file's name, when sharded

    @property
    def manifest(self) -> str:
        return self.stem + MANIFEST_SUFFIX

    def names(self) -> list[str]:
        return [name for name, _ in self.files] + ([self.index] if self.index else []) + [self.manifest]


def plan_output(out: str, infos: list[TensorInfo], *, max_shard_bytes: int = 0) -> OutputPlan:
    """Split `infos` (in order) into files of at most `max_shard_bytes` (0: one file)."""
    stripped = out.rstrip("/")
    if stripped.endswith(".safetensors"):
        folder, _, file = stripped.rpartition("/")
        folder, stem = folder or ".", file.removesuffix(".safetensors")
    else:
        folder, stem = stripped, "model"
    groups: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if max_shard_bytes and groups[-1] and size + info.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(info)
        size += info.nbytes
    if len(groups) == 1:
        return OutputPlan(folder, stem, [(f"{stem}.safetensors", groups[0])], None)
    n = len(groups)
    files = [(f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]
    return OutputPlan(folder, stem, files, stem + INDEX_SUFFIX)


@dataclass
class WriteResult:
    plan: OutputPlan
    records: dict[str, ObjectRecord] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.records.values())


def write_safetensors(
    plan: OutputPlan,
    pieces: Iterator[tuple[TensorInfo, torch.Tensor]],
    *,
    metadata: dict[str, str],
    manifest: dict[str, Any],
    overwrite: bool = False,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> WriteResult:
    """Stream `pieces` (one per source tensor, in plan order, converted to the plan's dtypes)."""
    location = open_location(plan.folder)
    _remove_stale(location, plan.names())
    existing = [n for n in plan.names() if not overwrite and location.exists(n)]
    if existing:
        raise StorageError(
            f"{plan.folder}: {', '.join(existing)} exist; pass --overwrite, or choose another name"
        )
    sinks: dict[str, Sink] = {}
    try:
        for name, _ in plan.files:
            sinks[name] = location.open_sink(name, overwrite=overwrite)
        for name, infos in plan.files:
            sinks[name].write(encode_header(infos, metadata))
        _stream_data(plan, list(sinks.values()), pieces, on_bytes)
        # The index and the manifest are written before anything is committed: a disk that fills
        # fails now, with nothing under OUT's names, never leaving files without their manifest.
        records = {name: sink.record() for name, sink in sinks.items()}
        if plan.index:
            sinks[plan.index] = _small(location, plan.index, _index_json(plan), records, overwrite=overwrite)
        body = {**manifest, "files": {n: vars(r) for n, r in records.items()}}
        sinks[plan.manifest] = _small(
            location, plan.manifest, _manifest_json(body), records, overwrite=overwrite
        )
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    return WriteResult(plan, _commit_all(location, sinks))


def _remove_stale(location: Location, names: list[str]) -> None:
    """What a killed write of these names left behind (its temporary files), removed and said so."""
    removed = (
        location.remove_stale_temporaries(names=set(names)) if isinstance(location, LocalLocation) else []
    )
    if removed:
        log.warning("removed %d temporary file(s) an interrupted write to %s left: %s", len(removed), location.uri,
                    ", ".join(removed))  # fmt: skip


def _small(
    location: Location, name: str, data: bytes, records: dict[str, ObjectRecord], *, overwrite: bool
) -> Sink:
    sink = location.open_sink(name, overwrite=overwrite)
    sink.write(data)
    records[name] = sink.record()
    return sink


def _commit_all(location: Location, sinks: dict[str, Sink]) -> dict[str, ObjectRecord]:
    """Commit in order, the manifest last; a commit that fails takes back those before it."""
    committed: dict[str, ObjectRecord] = {}
    try:
        for name, sink in sinks.items():
            committed[name] = sink.commit()
    except BaseException:
        for name, sink in sinks.items():
            if name in committed:
                location.delete(name)
            else:
                sink.abort()
        raise
    return committed


def _stream_data(
    plan: OutputPlan, sinks: list[Sink], pieces: Iterator[tuple[TensorInfo, torch.Tensor]], on_bytes: Callable
) -> None:
    targets = [(sink, info) for sink, (_, infos) in zip(sinks, plan.files) for info in infos]
    position, remaining = -1, 0
    # One writer thread (hashing and writing release the GIL) overlaps this thread's checks and
    # conversions; at most two pieces wait for it, in order.
    with ThreadPoolExecutor(1, thread_name_prefix="bigclip-write") as writer:
        pending: deque[Future] = deque()
        for source, piece in pieces:
            if remaining == 0:  # the next output tensor starts
                position += 1
                sink, target = targets[position]
                remaining = target.numel
            if piece.numel() > remaining:
                raise StorageError(
                    f"{source.name}: the source holds more elements than its shape {target.shape}"
                )
            data = piece.to(target.dtype).view(torch.uint8).numpy() if piece.numel() else b""
            pending.append(writer.submit(sink.write, memoryview(data)))
            if len(pending) > 2:
                pending.popleft().result()
            remaining -= piece.numel()
            on_bytes(len(data))
        for future in pending:
            future.result()
    if position != len(targets) - 1 or remaining:
        raise StorageError("the source ended before every tensor was written; nothing was committed")


def _index_json(plan: OutputPlan) -> bytes:
    weight_map = {info.name: name for name, infos in plan.files for info in infos}
    total = sum(info.nbytes for _, infos in plan.files for info in infos)
    return (
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    ).encode()


def _manifest_json(body: dict[str, Any]) -> bytes:
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return (
        json.dumps({"format": FORMAT, "version": 1, "created": created, **body}, indent=1) + "\n"
    ).encode()
