"""The safetensors file format, read and written without holding tensors in memory.

A file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
[begin, end) byte offsets into the data; `__metadata__`: str -> str), padded with spaces to a
multiple of 8, then the tensors' bytes back to back in row-major order. Since the header holds
only shapes and offsets, a writer that knows every tensor's shape up front can write it first
and then stream the data. Sharded models add a JSON index (Hugging Face's layout):
`{"metadata": {"total_size": N}, "weight_map": {name: file}}`.

`SafetensorsReader` reads one file or an index's shards tensor by tensor with ranged reads
(local or S3), with the same interface as `DcpReader`, so consolidation and `--pretrained`
treat both alike.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bigclip.checkpoint.integrity import StreamDigest, check_object
from bigclip.errors import StorageError
from bigclip.storage.ranged_reads import BlobFolder
from bigclip.storage.records import ObjectRecord
from bigclip.weights.dcp_reader import PIECE_BYTES, TensorInfo, prefetch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
INDEX_SUFFIX = ".safetensors.index.json"


def encode_header(infos: list[TensorInfo], metadata: dict[str, str]) -> bytes:
    """Length prefix + JSON header for `infos` stored in this order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for info in infos:
        if info.dtype not in CODES:
            raise StorageError(f"{info.name}: safetensors cannot store {info.dtype}")
        header[info.name] = {
            "dtype": CODES[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned, as the library writes it
    return struct.pack("<Q", len(body)) + body


@dataclass(frozen=True)
class StoredTensor:
    info: TensorInfo
    file: str
    start: int  # absolute byte offset in `file`


def read_header(blobs: BlobFolder, file: str) -> tuple[list[StoredTensor], dict[str, str], bytes]:
    """The tensors of one safetensors file (in data order), its metadata, and the header's bytes."""
    prefix = blobs.read(file, 0, 8)
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise StorageError(f"{blobs.uri(file)}: not a safetensors file (header of {length} bytes)")
    raw = blobs.read(file, 8, length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StorageError(f"{blobs.uri(file)}: not a safetensors file ({e})") from e
    metadata = header.pop("__metadata__", None) or {}
    stored = []
    for name, entry in header.items():
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise StorageError(f"{blobs.uri(file)}: {name} has unsupported dtype {entry.get('dtype')}")
        info = TensorInfo(name, dtype, tuple(entry["shape"]))
        begin, end = entry["data_offsets"]
        if end - begin != info.nbytes:
            raise StorageError(
                f"{blobs.uri(file)}: {name} spans {end - begin} bytes, its shape needs {info.nbytes}"
            )
        stored.append(StoredTensor(info, file, 8 + length + begin))
    stored.sort(key=lambda s: s.start)
    return stored, metadata, prefix + raw


@dataclass(frozen=True)
class Checked:
    """What a file's writer recorded, and what a mismatch says."""

    record: ObjectRecord
    where: str  # the object, as the user knows it
    advice: str  # what to do about damage

    def digest(self) -> StreamDigest:
        """A new hash of the file's bytes, checked against the record once all were fed."""
        return StreamDigest(self.record, where=self.where, advice=self.advice)


class SafetensorsReader:
    """One safetensors file, or the shards of an index, read tensor by tensor.

    `checked` (file name -> its writer's record) turns on verification: every read of a listed
    file is then one sequential pass over it, header to last byte, hashed as it arrives
    (`StreamDigest`), and the file's last piece is handed out only after its SHA-256 matched. So
    reads of such a file must follow file order (`tensors()`'s order), and bytes of tensors
    not asked for are read too (they are hashed). `read(name)` reads its whole file: use
    `read_each`."""

    def __init__(
        self, blobs: BlobFolder, name: str, *, window: int = 4, checked: dict[str, Checked] | None = None
    ) -> None:
        self.blobs, self.window, self.checked = blobs, window, dict(checked or {})
        index = self.checked.get(name) if name.endswith(INDEX_SUFFIX) else None
        files = _shard_files(blobs, name, index) if name.endswith(INDEX_SUFFIX) else [name]
        self._stored: dict[str, StoredTensor] = {}
        self._headers: dict[str, bytes] = {}  # header bytes of checked files: each pass hashes them first
        self.metadata: dict[str, str] = {}
        for file in files:
            stored, metadata, header = read_header(blobs, file)
            self.metadata = self.metadata or metadata
            self._stored |= {s.info.name: s for s in stored}
            if file in self.checked:
                self._headers[file] = header

    def tensors(self, prefix: str = "") -> list[TensorInfo]:
        return [s.info for s in self._stored.values() if s.info.name.startswith(prefix)]

    def read(self, name: str) -> torch.Tensor:
        if self._stored[name].file in self.checked:
            return next(self.read_each([name]))[1]
        s = self._stored[name]
        buffer = bytearray(s.info.nbytes)
        self.blobs.readinto(s.file, s.start, memoryview(buffer))
        return _as_tensor(buffer, s.info)

    def read_each(self, names: list[str], *, window: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors, in the order given (file order, for checked files), `window` read ahead."""
        infos = [self._stored[n].info for n in names]
        for info, data in self._pieces(infos, piece_bytes=0, window=window):
            yield info.name, _as_tensor(data, info)

    def stream(
        self, infos: list[TensorInfo], *, piece_bytes: int = PIECE_BYTES, window: int | None = None
    ) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
        """Each tensor as consecutive 1-D pieces (see DcpReader.stream)."""
        for info, data in self._pieces(infos, piece_bytes=piece_bytes, window=window or self.window):
            yield info, torch.frombuffer(data, dtype=info.dtype) if data else torch.empty(0, dtype=info.dtype)

    def _pieces(
        self, infos: list[TensorInfo], *, piece_bytes: int, window: int
    ) -> Iterator[tuple[TensorInfo, bytearray]]:
        """(tensor, bytes) pieces; checked files hashed in order, their last piece held until checked.

        Hashing runs on its own thread, in order (one worker): piece k is hashed while the caller
        uses piece k-1. A piece is handed out only once hashed, so the caller may change it."""
        digests = {
            f: self._digest(f) for f in {self._stored[i.name].file for i in infos} if f in self.checked
        }
        held: tuple[TensorInfo, bytearray, Future | None] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="bigclip-sha256") as hasher:
            for task, data in prefetch(self._tasks(infos, piece_bytes), self._fetch, window=window):
                digest = digests.get(task.file)
                hashed = hasher.submit(digest.update, data) if digest is not None and data else None
                if task.info is not None:
                    if held is not None:
                        yield _settled(held)
                    held = (task.info, data, hashed)
                if task.last:
                    hasher.submit(digest.check).result()  # after every earlier piece, before the last one
            if held is not None:
                yield _settled(held)

    def _digest(self, file: str) -> StreamDigest:
        digest = self.checked[file].digest()
        digest.update(self._headers[file])
        return digest

    def _tasks(self, infos: list[TensorInfo], piece_bytes: int) -> Iterator[_Task]:
        """Byte ranges to read, in order: for a checked file also the bytes between and after the
        tensors asked for (`info` None: hashed, not handed out), its last range marked."""
        last_use = {self._stored[i.name].file: k for k, i in enumerate(infos)}
        position = {f: len(h) for f, h in self._headers.items()}
        for k, info in enumerate(infos):
            s = self._stored[info.name]
            checked = s.file in self.checked
            if checked:
                if s.start < position[s.file]:
                    raise ValueError(
                        f"{self.blobs.uri(s.file)} is checked as it streams: read it in file order"
                    )
                yield from _ranges(s.file, None, position[s.file], s.start, piece_bytes or PIECE_BYTES)
                position[s.file] = s.start + info.nbytes
            yield from _ranges(
                s.file, info, s.start, s.start + info.nbytes, piece_bytes, itemsize=info.dtype.itemsize
            )
            if checked and last_use[s.file] == k:
                end = self.checked[s.file].record.size
                yield from _ranges(s.file, None, position[s.file], end, piece_bytes or PIECE_BYTES)
                yield _Task(s.file, None, 0, 0, last=True)

    def _fetch(self, task: _Task) -> bytearray:
        buffer = bytearray(task.nbytes)
        if task.nbytes:
            self.blobs.readinto(task.file, task.start, memoryview(buffer))
        return buffer


@dataclass(frozen=True)
class _Task:
    file: str
    info: TensorInfo | None  # None: bytes read only to be hashed
    start: int
    nbytes: int
    last: bool = False  # the file's digest is complete after this one


def _ranges(
    file: str, info: TensorInfo | None, begin: int, end: int, piece_bytes: int, *, itemsize: int = 1
) -> Iterator[_Task]:
    """[begin, end) in pieces of at most `piece_bytes` (0: one piece), whole elements each."""
    step = max(itemsize, piece_bytes - piece_bytes % itemsize) if piece_bytes else max(1, end - begin)
    if info is not None and begin == end:
        yield _Task(file, info, begin, 0)  # an empty tensor is still handed out
    for start in range(begin, end, step):
        yield _Task(file, info, start, min(step, end - start))


def _settled(held: tuple[TensorInfo, bytearray, Future | None]) -> tuple[TensorInfo, bytearray]:
    info, data, hashed = held
    if hashed is not None:
        hashed.result()
    return info, data


def _as_tensor(buffer: bytearray, info: TensorInfo) -> torch.Tensor:
    if not buffer:
        return torch.empty(info.shape, dtype=info.dtype)
    return torch.frombuffer(buffer, dtype=info.dtype).view(info.shape)


def _shard_files(blobs: BlobFolder, index_name: str, checked: Checked | None = None) -> list[str]:
    data = blobs.read_all(index_name)
    if checked is not None:
        check_object(data, checked.record, where=checked.where, advice=checked.advice)
    try:
        weight_map = json.loads(data)["weight_map"]
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise StorageError(f"{blobs.uri(index_name)}: not a safetensors index ({e})") from e
    folder = index_name.rpartition("/")[0]
    return sorted({f"{folder}/{f}" if folder else f for f in weight_map.values()})
