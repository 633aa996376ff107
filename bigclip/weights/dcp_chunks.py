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

Where the saving rank recorded the whole chunk's CRC-32 as it wrote it (its rank record), that
is what is checked, not the zip's: an intact chunk of another save passes its own zip's CRCs.
The payload's running CRC-32 then starts from the CRC-32 of the chunk's bytes before it (in the
head) and the bytes after it (the zip's directory, in the tail) are folded in at the end, so the
whole chunk is checked while only the payload streams (`PayloadCrc`).

Chunks written raw (DCP's safetensors serialization: exactly numel * itemsize bytes, no zip)
are described by the metadata alone and carry no CRC of their own. Chunks with stream
transforms (compression extensions) have no stable payload range; they are read whole (`load_chunk`).
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
    not_as_written,
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
class PayloadCrc:
    """What a payload's bytes, streamed in order from `seed`, are checked against: the whole
    chunk's CRC-32 as written (`written`; `seed` is the CRC-32 of the bytes before the payload,
    and the `tail_len` bytes after it fold in as `tail_fold`), or the zip's CRC-32 of the storage record."""

    expected: int
    written: bool
    seed: int = 0
    tail_len: int = 0
    tail_fold: int = 0

    @classmethod
    def of_chunk(cls, written: int, before: bytes, after: bytes) -> PayloadCrc:
        # CRC-32 is affine in its start value: crc32(after, c) == crc32(zeros, c) ^ crc32(zeros) ^ crc32(after)
        fold = zlib.crc32(bytes(len(after))) ^ zlib.crc32(after)
        return cls(written, True, zlib.crc32(before), len(after), fold)

    def found(self, running: int) -> int:
        """The checked value, from the payload's running CRC-32 (started at `seed`)."""
        return zlib.crc32(bytes(self.tail_len), running) ^ self.tail_fold if self.tail_len else running


@dataclass(frozen=True)
class Payload:
    """The stored tensor of a chunk: its storage bytes [start, start + nbytes) in `chunk.file`."""

    chunk: Chunk
    start: int
    nbytes: int
    crc: PayloadCrc | None
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def seed(self) -> int:
        """Where the payload's running CRC-32 starts."""
        return self.crc.seed if self.crc else 0

    @property
    def row_major(self) -> bool:
        """The storage is exactly the box's elements in row-major order."""
        numel = math.prod(self.size)
        expected = torch.empty(self.size, device="meta").stride() if self.size else ()
        dense = numel <= 1 or all(st == e for st, e, n in zip(self.stride, expected, self.size) if n != 1)
        return dense and self.storage_offset == 0 and self.nbytes == numel * self.dtype.itemsize


def damaged(blobs: BlobFolder, chunk: Chunk, key: str, why: str) -> CheckpointDamaged:
    return integrity.damaged(f"{blobs.uri(chunk.file)} (byte {chunk.offset})", key, why)


def locate_payload(
    blobs: BlobFolder, chunk: Chunk, key: str, dtype: torch.dtype, *, written: int | None = None
) -> Payload | None:
    """The chunk's payload range, or None when it has stream transforms (read it with load_chunk).
    The zip's small records (the pickle, the version) are checked against their CRC-32 here.
    `written`: the whole chunk's CRC-32 as its writer recorded it, if it did."""
    if chunk.transforms:
        return None
    head = blobs.read(chunk.file, chunk.offset, min(chunk.length, HEAD_BYTES))
    if not head.startswith(ZIP_MAGIC):
        if chunk.length != chunk.numel * dtype.itemsize:
            raise damaged(blobs, chunk, key, "is neither a torch.save zip nor raw tensor bytes")
        stride = torch.empty(chunk.sizes, device="meta").stride()
        crc = None if written is None else PayloadCrc(written, True)
        return Payload(chunk, chunk.offset, chunk.length, crc, dtype, chunk.sizes, stride, 0)
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
        if not record.is_storage and not crc_matches(_record_bytes(view, record.start, record.end), record):
            raise damaged(
                blobs, chunk, key, f"(record {record.name}) does not match the CRC-32 its writer recorded"
            )
    record = data[0]
    if written is None:
        crc = PayloadCrc(record.crc32, False)
    else:
        before, after = _record_bytes(view, 0, record.start), _record_bytes(view, record.end, chunk.length)
        crc = PayloadCrc.of_chunk(written, before, after)
    return _payload_of(blobs, chunk, key, meta, record, crc)


def _record_bytes(view: io.RawIOBase, start: int, end: int) -> bytes:
    view.seek(start)
    return view.read(end - start)


def _payload_of(
    blobs: BlobFolder, chunk: Chunk, key: str, meta: torch.Tensor, record: ZipRecord, crc: PayloadCrc
) -> Payload:
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
        crc=crc,
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
    check_crc(blobs, payload, key, zlib.crc32(buffer, payload.seed))
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


def check_crc(blobs: BlobFolder, payload: Payload, key: str, running: int) -> None:
    """`running`: the payload's CRC-32 from `payload.seed`, computed as it streamed (one piece or
    several, in order)."""
    crc = payload.crc
    if crc is None or crc.found(running) == crc.expected:
        return
    why = (
        not_as_written(crc.found(running), crc.expected)
        if crc.written
        else "does not match the CRC-32 its writer recorded"
    )
    raise damaged(blobs, payload.chunk, key, why)


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
