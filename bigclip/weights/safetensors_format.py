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
from dataclasses import dataclass

import torch

from bigclip.errors import StorageError
from bigclip.storage.blobs import BlobFolder
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


def read_header(blobs: BlobFolder, file: str) -> tuple[list[StoredTensor], dict[str, str]]:
    """The tensors of one safetensors file (in data order) and its metadata."""
    (length,) = struct.unpack("<Q", blobs.read(file, 0, 8))
    if length > MAX_HEADER_BYTES:
        raise StorageError(f"{blobs.uri(file)}: not a safetensors file (header of {length} bytes)")
    try:
        header = json.loads(blobs.read(file, 8, length))
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
    return stored, metadata


class SafetensorsReader:
    """One safetensors file, or the shards of an index, read tensor by tensor."""

    def __init__(self, blobs: BlobFolder, name: str, *, window: int = 4) -> None:
        self.blobs, self.window = blobs, window
        files = _shard_files(blobs, name) if name.endswith(INDEX_SUFFIX) else [name]
        self._stored: dict[str, StoredTensor] = {}
        self.metadata: dict[str, str] = {}
        for file in files:
            stored, metadata = read_header(blobs, file)
            self.metadata = self.metadata or metadata
            self._stored |= {s.info.name: s for s in stored}

    def tensors(self, prefix: str = "") -> list[TensorInfo]:
        return [s.info for s in self._stored.values() if s.info.name.startswith(prefix)]

    def read(self, name: str) -> torch.Tensor:
        s = self._stored[name]
        buffer = bytearray(s.info.nbytes)
        self.blobs.readinto(s.file, s.start, memoryview(buffer))
        return _as_tensor(buffer, s.info)

    def stream(
        self, infos: list[TensorInfo], *, piece_bytes: int = PIECE_BYTES, window: int | None = None
    ) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
        """Each tensor as consecutive 1-D pieces (see DcpReader.stream)."""
        tasks = []
        for info in infos:
            s = self._stored[info.name]
            step = max(info.dtype.itemsize, piece_bytes - piece_bytes % info.dtype.itemsize)
            tasks += [(s, b, min(step, info.nbytes - b)) for b in range(0, info.nbytes, step)]

        def fetch(task: tuple[StoredTensor, int, int]) -> bytearray:
            s, begin, n = task
            buffer = bytearray(n)
            self.blobs.readinto(s.file, s.start + begin, memoryview(buffer))
            return buffer

        for (s, _, _), data in prefetch(tasks, fetch, window=window or self.window):
            yield s.info, torch.frombuffer(data, dtype=s.info.dtype)


def _as_tensor(buffer: bytearray, info: TensorInfo) -> torch.Tensor:
    if not buffer:
        return torch.empty(info.shape, dtype=info.dtype)
    return torch.frombuffer(buffer, dtype=info.dtype).view(info.shape)


def _shard_files(blobs: BlobFolder, index_name: str) -> list[str]:
    try:
        weight_map = json.loads(blobs.read_all(index_name))["weight_map"]
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise StorageError(f"{blobs.uri(index_name)}: not a safetensors index ({e})") from e
    folder = index_name.rpartition("/")[0]
    return sorted({f"{folder}/{f}" if folder else f for f in weight_map.values()})
