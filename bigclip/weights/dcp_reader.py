"""A DCP checkpoint read tensor by tensor, in bounded memory, from a local folder or S3.

`.metadata` (read with the restricted unpickler) gives every tensor's global shape, dtype and
chunks; `dcp_chunks` finds each chunk's payload bytes. When a tensor's chunks are contiguous
row-major ranges of it (FSDP2's dim-0 shards, the DeepSpeed engine's ZeRO fragments, whole
tensors), `stream` yields the tensor as row-major pieces read straight from the chunks'
payloads: memory stays at `window` pieces whatever the tensor size, and every byte is read
once. Other layouts (shards along another dim, 2-D meshes) are assembled in memory first:
one whole tensor plus one chunk. Reads run ahead on a few threads (`window` pieces), which
keeps S3 busy while the caller converts and writes.
"""

from __future__ import annotations

import bisect
import math
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from bigclip.checkpoint.integrity import check_object, check_written
from bigclip.checkpoint.rank_record import read_chunk_crcs
from bigclip.errors import StorageError
from bigclip.storage.ranged_reads import BlobFolder
from bigclip.storage.records import ObjectRecord
from bigclip.storage.safe_metadata import load_metadata
from bigclip.weights.dcp_chunks import (
    Chunk,
    Payload,
    check_crc,
    checked_value,
    damaged,
    load_chunk,
    locate_payload,
)

METADATA_NAME = ".metadata"
PIECE_BYTES = 16 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class WrittenCrcs:
    """Each chunk's CRC-32 as its rank wrote it, by file: sorted offsets and their CRC-32s in two
    arrays, 12 bytes a chunk (a ViT-bigG-14 checkpoint of 1024 ranks has about 3 million chunks;
    a dict of Python ints would take ~100 bytes each)."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[array, array]] = {}

    def add(self, file: str, by_offset: dict[int, int]) -> None:
        offsets = sorted(by_offset)
        self._files[file] = (array("Q", offsets), array("I", (by_offset[o] for o in offsets)))

    def get(self, file: str, offset: int) -> int | None:
        offsets, crcs = self._files.get(file, (array("Q"), array("I")))
        i = bisect.bisect_left(offsets, offset)
        return crcs[i] if i < len(offsets) and offsets[i] == offset else None


# One unit of read-ahead work: a byte range of a payload, or (payload None) a whole tensor.
_Task = tuple[TensorInfo, Payload | None, int, int]


class DcpReader:
    """Tensors and values of one DCP checkpoint folder (see module docstring)."""

    def __init__(
        self,
        blobs: BlobFolder,
        *,
        threads: int = 8,
        metadata_record: ObjectRecord | None = None,
        rank_records: Sequence[str] = (),
    ) -> None:
        """`metadata_record`: `.metadata`'s size and SHA-256 from the manifest, checked on this read;
        `rank_records`: the saved ranks' records, whose CRC-32 of each chunk as written is what
        the chunks are checked against (without them, each chunk's own zip CRC-32s)."""
        self.blobs = blobs
        self.threads = threads
        data = blobs.read_all(METADATA_NAME)
        check_object(data, metadata_record, where=blobs.uri(METADATA_NAME))
        self.metadata = load_metadata(data)
        self._written = WrittenCrcs()
        with ThreadPoolExecutor(threads) as pool:  # tens of KB each, one ranged read per part
            for by_file in pool.map(lambda record: read_chunk_crcs(blobs, record), rank_records):
                for file, by_offset in by_file.items():
                    self._written.add(file, by_offset)
        self._infos: dict[str, TensorInfo] = {}
        self._chunks: dict[str, list[Chunk]] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                self._infos[key] = TensorInfo(key, md.properties.dtype, tuple(md.size))
                self._chunks[key] = [self._chunk(key, c.offsets, c.sizes) for c in md.chunks]
        self._payloads: dict[Chunk, Payload | None] = {}

    def _chunk(self, key: str, offsets: Iterable[int], sizes: Iterable[int]) -> Chunk:
        info = self.metadata.storage_data.get(MetadataIndex(key, list(offsets)))
        if info is None:
            raise StorageError(f"{self.blobs.uri(METADATA_NAME)}: no storage recorded for a chunk of {key}")
        transforms = tuple(getattr(info, "transform_descriptors", None) or ())
        return Chunk(tuple(offsets), tuple(sizes), info.relative_path, info.offset, info.length, transforms)

    def tensors(self, prefix: str = "") -> list[TensorInfo]:
        """Every tensor whose key starts with `prefix`, in the saved state dict's order."""
        return [info for key, info in self._infos.items() if key.startswith(prefix)]

    def value_keys(self, prefix: str = "") -> list[str]:
        """Keys of non-tensor values (ints, strings, lists...) under `prefix`."""
        return [k for k in self.metadata.state_dict_metadata if k.startswith(prefix) and k not in self._infos]

    def read_value(self, key: str) -> Any:
        info = self.metadata.storage_data[MetadataIndex(key)]
        chunk = Chunk((), (), info.relative_path, info.offset, info.length)
        data = bytearray(self.blobs.read(chunk.file, chunk.offset, chunk.length))
        written = self._written_crc(chunk)
        if written is not None:
            check_written(memoryview(data), written, where=self.blobs.uri(chunk.file), key=key)
        return checked_value(self.blobs, chunk, key, data)

    def _written_crc(self, chunk: Chunk) -> int | None:
        """The chunk's CRC-32 as its writer recorded it (none for transformed chunks, as written)."""
        return None if chunk.transforms else self._written.get(chunk.file, chunk.offset)

    # -- tensors --------------------------------------------------------------------------

    def locate(self, infos: Iterable[TensorInfo]) -> None:
        """Find every chunk's payload (two small reads each), in parallel; idempotent."""
        todo = [(info, c) for info in infos for c in self._chunks[info.name] if c not in self._payloads]
        with ThreadPoolExecutor(self.threads) as pool:
            found = pool.map(lambda ic: self._locate(*ic), todo)
            for (info, chunk), payload in zip(todo, found):
                if payload is not None and payload.dtype != info.dtype:
                    raise damaged(self.blobs, chunk, info.name, f"holds {payload.dtype}, not {info.dtype}")
                self._payloads[chunk] = payload

    def _locate(self, info: TensorInfo, chunk: Chunk) -> Payload | None:
        return locate_payload(self.blobs, chunk, info.name, info.dtype, written=self._written_crc(chunk))

    def read(self, name: str) -> torch.Tensor:
        """One whole tensor (memory: the tensor plus one chunk)."""
        info = self._infos[name]
        self.locate([info])
        full = torch.empty(info.shape, dtype=info.dtype)
        for chunk in _nonempty(self._chunks[name]):
            piece = load_chunk(self.blobs, chunk, name, self._payloads[chunk])
            full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = piece
        return full

    def read_each(self, names: list[str], *, window: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors in the order given, `window` read ahead on threads."""
        yield from prefetch(names, self.read, window=window)

    def stream(
        self, infos: list[TensorInfo], *, piece_bytes: int = PIECE_BYTES, window: int = 4
    ) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
        """Each tensor as consecutive 1-D row-major pieces (views; copy to keep), tensor after tensor."""
        self.locate(infos)
        tasks = (task for info in infos for task in self._tasks(info, piece_bytes))
        crc = 0
        for (info, payload, start, nbytes), (data, piece_crc) in prefetch(tasks, self._fetch, window=window):
            if payload is None:  # assembled in memory: cut into pieces without copying
                yield from cut_whole(info, data, piece_bytes)
                continue
            if piece_crc is None:  # a payload in several pieces: its CRC runs across them, in order
                piece_crc = zlib.crc32(data, payload.seed if start == payload.start else crc)
            crc = piece_crc
            if start + nbytes == payload.start + payload.nbytes:
                check_crc(self.blobs, payload, info.name, crc)
            yield info, torch.frombuffer(data, dtype=info.dtype)

    def _tasks(self, info: TensorInfo, piece_bytes: int) -> list[_Task]:
        payloads = self._row_major_payloads(info)
        if payloads is None:
            return [(info, None, 0, info.nbytes)]
        step = max(info.dtype.itemsize, piece_bytes - piece_bytes % info.dtype.itemsize)
        return [
            (info, p, start, min(step, p.start + p.nbytes - start))
            for p in payloads
            for start in range(p.start, p.start + p.nbytes, step)
        ]

    def _fetch(self, task: _Task) -> tuple[Any, int | None]:
        """The task's data, and its CRC-32 when it is a whole payload (computed here, on the
        read-ahead threads, in parallel: zlib releases the GIL)."""
        info, payload, start, nbytes = task
        if payload is None:
            return self.read(info.name), None
        buffer = bytearray(nbytes)
        self.blobs.readinto(payload.chunk.file, start, memoryview(buffer))
        return buffer, zlib.crc32(buffer, payload.seed) if nbytes == payload.nbytes else None

    def _row_major_payloads(self, info: TensorInfo) -> list[Payload] | None:
        """The payloads in tensor order when they tile it as contiguous row-major ranges, else None."""
        ranges = []
        for chunk in _nonempty(self._chunks[info.name]):
            payload = self._payloads[chunk]
            if payload is None or not payload.row_major or not _box_is_contiguous(info.shape, chunk):
                return None
            ranges.append((_flat_index(info.shape, chunk.offsets), payload))
        ranges.sort(key=lambda r: r[0])
        position = 0
        for start, payload in ranges:
            if start > position:
                raise StorageError(f"{self.blobs.uri(METADATA_NAME)}: elements [{position}, {start}) of "
                                   f"{info.name} are in no chunk; the checkpoint is incomplete")  # fmt: skip
            if start < position:
                return None  # overlapping boxes: let assembly resolve them
            position += payload.chunk.numel
        if position != info.numel:
            raise StorageError(f"{self.blobs.uri(METADATA_NAME)}: {info.name} has chunks for "
                               f"{position} of its {info.numel} elements; the checkpoint is incomplete")  # fmt: skip
        return [payload for _, payload in ranges]


def cut_whole(
    info: TensorInfo, tensor: torch.Tensor, piece_bytes: int
) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """A whole tensor as consecutive 1-D row-major pieces of `piece_bytes` (views where it is contiguous)."""
    flat, step = tensor.reshape(-1), max(1, piece_bytes // info.dtype.itemsize)
    for i in range(0, flat.numel(), step):
        yield info, flat[i : i + step]


def _nonempty(chunks: list[Chunk]) -> list[Chunk]:
    """Chunks with elements, each box once (DCP may record a replicated box on several ranks)."""
    seen, out = set(), []
    for c in chunks:
        if c.numel and (c.offsets, c.sizes) not in seen:
            seen.add((c.offsets, c.sizes))
            out.append(c)
    return out


def _box_is_contiguous(shape: tuple[int, ...], chunk: Chunk) -> bool:
    """A box is one row-major range iff after its first dim of size > 1 it spans whole dims."""
    dims = [i for i, s in enumerate(chunk.sizes) if s > 1]
    return not dims or all(chunk.sizes[i] == shape[i] for i in range(dims[0] + 1, len(shape)))


def _flat_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    index = 0
    for size, offset in zip(shape, offsets):
        index = index * size + offset
    return index


def prefetch(tasks: Iterable[T], fetch: Callable[[T], Any], *, window: int) -> Iterator[tuple[T, Any]]:
    """`(task, fetch(task))` in task order, with up to `window` fetches running ahead on threads."""
    pending: list[tuple[T, Future]] = []
    with ThreadPoolExecutor(max(1, window)) as pool:
        try:
            for task in tasks:
                pending.append((task, pool.submit(fetch, task)))
                if len(pending) >= window:
                    first, future = pending.pop(0)
                    yield first, future.result()
            for task, future in pending:
                yield task, future.result()
        finally:
            for _, future in pending:
                future.cancel()
