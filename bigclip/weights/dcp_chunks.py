"""Where a DCP chunk's tensor bytes are, found without reading them.

DCP's `FileSystemWriter` stores each chunk (a box of a tensor) as one `torch.save` zip inside a
`.distcp` file; `.metadata` gives the zip's byte range (`_StorageInfo`). The zip holds a small
pickle (dtype, size, stride, storage offset), the storage bytes uncompressed at a 64-byte
aligned offset, and a central directory with each record's CRC-32. We read only the zip's head
and tail (one ranged read each; both are a few hundred bytes), describe the tensor with
`torch.load(map_location="meta", weights_only=True)` (which reads no storage and runs no code)
and take the storage record's CRC-32 and offset from the zip directory and local header. The payload can then be
streamed in pieces straight from storage, its CRC-32 checked on the way: a tampered or torn
chunk fails with the object named, at no extra I/O.

Chunks written raw (DCP's safetensors serialization: exactly numel * itemsize bytes, no zip)
are described by the metadata alone and carry no CRC. Chunks with stream transforms
(compression extensions) have no stable payload range; they are read whole (`load_chunk`).
"""

from __future__ import annotations

import io
import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

from bigclip.checkpoint import integrity
from bigclip.checkpoint.integrity import (
    ZIP_MAGIC,
    CheckpointDamaged,
    MemoryFile,
    SeekableView,
    ZipRecord,
    check_chunk,
    crc_matches,
    tensor_of,
    zip_records,
)
from bigclip.storage.ranged_reads import BlobFolder

HEAD_BYTES = TAIL_BYTES = 16 << 10  # a tensor's pickle and a zip directory take < 2 KiB


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: global offsets and sizes, and the zip's byte range."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Payload:
    """The stored tensor of a chunk: its storage bytes [start, start + nbytes) in `chunk.file`."""

    chunk: Chunk
    start: int
    nbytes: int
    crc32: int | None
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def row_major(self) -> bool:
        """The storage is exactly the box's elements in row-major order."""
        numel = math.prod(self.size)
        expected = torch.empty(self.size, device="meta").stride() if self.size else ()
        dense = numel <= 1 or all(st == e for st, e, n in zip(self.stride, expected, self.size) if n != 1)
        return dense and self.storage_offset == 0 and self.nbytes == numel * self.dtype.itemsize


def damaged(blobs: BlobFolder, chunk: Chunk, key: str, why: str) -> CheckpointDamaged:
    return integrity.damaged(f"{blobs.uri(chunk.file)} (byte {chunk.offset})", key, why)


def locate_payload(blobs: BlobFolder, chunk: Chunk, key: str, dtype: torch.dtype) -> Payload | None:
    """The chunk's payload range, or None when it has stream transforms (read it with load_chunk).
    The zip's small records (the pickle, the version) are checked against their CRC-32 here."""
    if chunk.transforms:
        return None
    head = blobs.read(chunk.file, chunk.offset, min(chunk.length, HEAD_BYTES))
    if not head.startswith(ZIP_MAGIC):
        if chunk.length != chunk.numel * dtype.itemsize:
            raise damaged(blobs, chunk, key, "is neither a torch.save zip nor raw tensor bytes")
        stride = torch.empty(chunk.sizes, device="meta").stride()
        return Payload(chunk, chunk.offset, chunk.length, None, dtype, chunk.sizes, stride, 0)
    view = _HeadTailView(blobs, chunk, head)
    try:
        records = zip_records(view)
        view.seek(0)
        meta = torch.load(view, map_location="meta", weights_only=True)
    except Exception as e:  # any parse error means the bytes are not what DCP wrote
        raise damaged(blobs, chunk, key, f"cannot be parsed ({type(e).__name__}: {e})") from e
    data = [r for r in records if r.is_storage]
    if len(data) != 1 or not data[0].stored:
        raise damaged(blobs, chunk, key, "is not a single uncompressed tensor record")
    for record in records:
        if not record.is_storage and not crc_matches(_record_bytes(view, record), record):
            raise damaged(
                blobs, chunk, key, f"(record {record.name}) does not match the CRC-32 its writer recorded"
            )
    return _payload_of(blobs, chunk, key, meta, data[0])


def _record_bytes(view: io.RawIOBase, record: ZipRecord) -> bytes:
    view.seek(record.start)
    return view.read(record.nbytes)


def _payload_of(blobs: BlobFolder, chunk: Chunk, key: str, meta: torch.Tensor, record: ZipRecord) -> Payload:
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != chunk.sizes:
        raise damaged(
            blobs, chunk, key, f"holds {type(meta).__name__} {getattr(meta, 'shape', '')}, not {chunk.sizes}"
        )
    storage = meta.untyped_storage()
    if record.nbytes != storage.nbytes():
        raise damaged(blobs, chunk, key, f"stores {record.nbytes} bytes, its tensor needs {storage.nbytes()}")
    return Payload(
        chunk=chunk,
        start=chunk.offset + record.start,
        nbytes=record.nbytes,
        crc32=record.crc32,
        dtype=meta.dtype,
        size=tuple(meta.shape),
        stride=tuple(meta.stride()),
        storage_offset=meta.storage_offset(),
    )


def load_chunk(blobs: BlobFolder, chunk: Chunk, key: str, payload: Payload | None) -> torch.Tensor:
    """The chunk's tensor, whole, in row-major order (memory: one chunk, plus its zip if transformed)."""
    if payload is None:
        raw = io.BytesIO(blobs.read(chunk.file, chunk.offset, chunk.length))
        stream = _StorageReaderTransforms().transform_load_stream(None, chunk.transforms, raw)
        return checked_value(blobs, chunk, key, bytearray(stream.read())).contiguous()
    buffer = bytearray(payload.nbytes)
    blobs.readinto(chunk.file, payload.start, memoryview(buffer))
    check_crc(blobs, payload, key, zlib.crc32(buffer))
    storage = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    flat = storage.view(payload.dtype)
    return flat.as_strided(payload.size, payload.stride, payload.storage_offset).contiguous()


def checked_value(blobs: BlobFolder, chunk: Chunk, key: str, data: bytearray) -> Any:
    """A whole chunk's value (a tensor on `data`'s memory, or plain data), every record's CRC-32
    checked first."""
    where = f"{blobs.uri(chunk.file)} (byte {chunk.offset})"
    records = check_chunk(memoryview(data), where=where, key=key)
    if any(r.is_storage for r in records):
        return tensor_of(memoryview(data), records, where=where, key=key)
    try:
        return torch.load(MemoryFile(memoryview(data)), weights_only=True)
    except Exception as e:  # a value that is not plain data
        raise damaged(blobs, chunk, key, f"cannot be read as plain data ({e})") from e


def check_crc(blobs: BlobFolder, payload: Payload, key: str, actual: int) -> None:
    """`actual`: the payload's CRC-32, computed as it streamed (one piece or several, in order)."""
    if payload.crc32 is not None and actual != payload.crc32:
        raise damaged(blobs, payload.chunk, key, "does not match the CRC-32 its writer recorded")


class _HeadTailView(SeekableView):
    """A view of one chunk's zip that serves the head and tail from memory.

    torch.load and zipfile make many small reads (end-of-directory, directory, local headers,
    the pickle); against S3 each would be a request. The tail is fetched on first use."""

    def __init__(self, blobs: BlobFolder, chunk: Chunk, head: bytes) -> None:
        super().__init__(chunk.length)
        self._blobs, self._chunk, self._head = blobs, chunk, head
        self._tail: bytes | None = None
        self._tail_start = max(0, chunk.length - TAIL_BYTES)

    def _slice(self, start: int, end: int) -> bytes:
        if end <= len(self._head):
            return self._head[start:end]
        if start >= self._tail_start:
            if self._tail is None:
                c = self._chunk
                self._tail = self._blobs.read(
                    c.file, c.offset + self._tail_start, c.length - self._tail_start
                )
            return self._tail[start - self._tail_start : end - self._tail_start]
        return self._blobs.read(self._chunk.file, self._chunk.offset + start, end - start)
