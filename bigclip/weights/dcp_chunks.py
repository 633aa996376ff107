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
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

from bigclip.errors import StorageError
from bigclip.storage.blobs import BlobFolder

ZIP_MAGIC = b"PK\x03\x04"
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


def damaged(blobs: BlobFolder, chunk: Chunk, key: str, why: str) -> StorageError:
    return StorageError(
        f"{blobs.uri(chunk.file)} is damaged: chunk of {key} at byte {chunk.offset} {why}. "
        "Re-copy the checkpoint, or use another one (`bigclip checkpoints verify` lists every damaged object)"
    )


def locate_payload(blobs: BlobFolder, chunk: Chunk, key: str, dtype: torch.dtype) -> Payload | None:
    """The chunk's payload range, or None when it has stream transforms (read it with load_chunk)."""
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
        meta = torch.load(view, map_location="meta", weights_only=True)
        view.seek(0)
        data = [r for r in zipfile.ZipFile(view).infolist() if "/data/" in r.filename]
        start = _data_start(view, data[0]) if len(data) == 1 else None
    except Exception as e:  # any parse error means the bytes are not what DCP wrote
        raise damaged(blobs, chunk, key, f"cannot be parsed ({type(e).__name__}: {e})") from e
    if start is None or data[0].compress_type != zipfile.ZIP_STORED:
        raise damaged(blobs, chunk, key, "is not a single uncompressed tensor record")
    return _payload_of(blobs, chunk, key, meta, data[0], start)


def _data_start(view: io.RawIOBase, record: zipfile.ZipInfo) -> int:
    """Where a zip record's bytes begin: after its local header (30 bytes, name, extra field)."""
    view.seek(record.header_offset)
    header = view.read(30)
    if len(header) != 30 or not header.startswith(ZIP_MAGIC):
        raise ValueError(f"no local header for {record.filename}")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return record.header_offset + 30 + name_length + extra_length


def _payload_of(
    blobs: BlobFolder, chunk: Chunk, key: str, meta: torch.Tensor, record: zipfile.ZipInfo, start: int
) -> Payload:
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != chunk.sizes:
        raise damaged(
            blobs, chunk, key, f"holds {type(meta).__name__} {getattr(meta, 'shape', '')}, not {chunk.sizes}"
        )
    storage = meta.untyped_storage()
    if record.file_size != storage.nbytes():
        raise damaged(
            blobs, chunk, key, f"stores {record.file_size} bytes, its tensor needs {storage.nbytes()}"
        )
    return Payload(
        chunk=chunk,
        start=chunk.offset + start,
        nbytes=record.file_size,
        crc32=record.CRC,
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
        try:
            return torch.load(io.BytesIO(stream.read()), map_location="cpu", weights_only=True)
        except Exception as e:
            raise damaged(blobs, chunk, key, f"cannot be loaded ({e})") from e
    buffer = bytearray(payload.nbytes)
    blobs.readinto(chunk.file, payload.start, memoryview(buffer))
    check_crc(blobs, payload, key, zlib.crc32(buffer))
    storage = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    flat = storage.view(payload.dtype)
    return flat.as_strided(payload.size, payload.stride, payload.storage_offset).contiguous()


def check_crc(blobs: BlobFolder, payload: Payload, key: str, actual: int) -> None:
    if payload.crc32 is not None and actual != payload.crc32:
        raise damaged(blobs, payload.chunk, key, "does not match the CRC-32 its writer recorded")


class _HeadTailView(io.RawIOBase):
    """A read-only, seekable view of one chunk's zip that serves the head and tail from memory.

    torch.load and zipfile make many small reads (end-of-directory, directory, local headers,
    the pickle); against S3 each would be a request. The tail is fetched on first use."""

    def __init__(self, blobs: BlobFolder, chunk: Chunk, head: bytes) -> None:
        super().__init__()
        self._blobs, self._chunk, self._head = blobs, chunk, head
        self._tail: bytes | None = None
        self._tail_start = max(0, chunk.length - TAIL_BYTES)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._chunk.length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:
        end = min(self._pos + len(buffer), self._chunk.length)
        if end <= self._pos:
            return 0
        data = self._slice(self._pos, end)
        memoryview(buffer)[: len(data)] = data
        self._pos += len(data)
        return len(data)

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
