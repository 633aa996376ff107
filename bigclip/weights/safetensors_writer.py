"""Writing a stream of tensor pieces as safetensors: one file, or shards with an index.

The layout is planned before any data moves: output names, dtypes and shapes are known from
the source's metadata, so each file's header is written first and the tensors' bytes follow
as they stream in, converted piece by piece. All files are committed together at the end,
then the index, then the checksum manifest (the commit marker): an interrupted write leaves
temporary files (locally) or aborted uploads (S3), never a file under its final name.

Naming follows Hugging Face: OUT ending in `.safetensors` is the file (shards and index go
beside it as STEM-00001-of-0000N.safetensors and STEM.safetensors.index.json); any other OUT
is a folder receiving model.safetensors (or model-0000i-of-0000N.safetensors + index).
"""

from __future__ import annotations

import datetime
import json
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from bigclip.errors import StorageError
from bigclip.storage.locations import Location, open_location
from bigclip.storage.records import ObjectRecord
from bigclip.storage.sinks import Sink
from bigclip.weights.dcp_reader import TensorInfo
from bigclip.weights.safetensors_format import INDEX_SUFFIX, encode_header

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
    existing = [n for n in plan.names() if not overwrite and location.exists(n)]
    if existing:
        raise StorageError(
            f"{plan.folder}: {', '.join(existing)} exist; pass --overwrite, or choose another name"
        )
    sinks: list[Sink] = []
    try:
        for name, _ in plan.files:
            sinks.append(location.open_sink(name, overwrite=overwrite))
        for sink, (_, infos) in zip(sinks, plan.files):
            sink.write(encode_header(infos, metadata))
        _stream_data(plan, sinks, pieces, on_bytes)
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    result = WriteResult(plan, {name: sink.commit() for (name, _), sink in zip(plan.files, sinks)})
    if plan.index:
        _write_small(location, plan.index, _index_json(plan), result, overwrite=overwrite)
    body = {**manifest, "files": {n: vars(r) for n, r in result.records.items()}}
    _write_small(location, plan.manifest, _manifest_json(body), result, overwrite=overwrite)
    return result


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


def _write_small(location: Location, name: str, data: bytes, result: WriteResult, *, overwrite: bool) -> None:
    sink = location.open_sink(name, overwrite=overwrite)
    sink.write(data)
    result.records[name] = sink.commit()
