"""A rank's own record in a checkpoint: its DCP metadata and its training state, sealed.

Each rank writes `PREFIXrank.bigclip` beside its shard files (under its own key prefix on S3:
storage/rank_prefixes.py), so that a resume reads what it
needs and no more: its RNG and data position (the JSON part), and the DCP metadata of the few
saved ranks whose chunks overlap its own (the metadata part), instead of DCP's global
`.metadata`, which holds every rank's chunks (~0.5 GB for ViT-bigG-14 at 1024 ranks). Both parts
carry the SHA-256 their writer computed, checked on every read: a rank reads its record without
the manifest (which lists every rank's objects, O(world) bytes), and still nothing unverified is
used. The manifest lists the records too, so `verify` and retention treat them as any object.

    header   MAGIC, the two parts' lengths (<QQ), their SHA-256 digests (32 bytes each)
    json     {"train": this rank's training state, "chunks": {file: {offset: CRC-32}}: each chunk's
             CRC-32 as it was written (storage/hashing.py), which binds a shard file to this save:
             an intact file of another checkpoint passes its own zip's CRCs, not these}
    pickle   this rank's DCP Metadata (its chunks and storage records; read with the
             restricted unpickler)
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from bigclip.checkpoint.integrity import CheckpointDamaged
from bigclip.storage.locations import Location
from bigclip.storage.ranged_reads import BlobFolder
from bigclip.storage.rank_prefixes import prefix
from bigclip.storage.safe_metadata import load_metadata

MAGIC = b"bigclip-rank-record/1\n"
SUFFIX = "rank.bigclip"
_LENGTHS = struct.Struct("<QQ")
HEADER_BYTES = len(MAGIC) + _LENGTHS.size + 64


def record_name(prefix: str) -> str:
    """The record of the rank whose objects are named `prefix...` (`__R_`, or `<hex>/__R_` on S3)."""
    return f"{prefix}{SUFFIX}"


def record_of(rule: str, rank: int, world_size: int) -> str:
    """Saved rank `rank`'s record in a checkpoint whose manifest gives `rule` and `world_size`."""
    return record_name(prefix(rule, rank, world_size))


ChunkCrcs = dict[tuple[str, int], int]  # (file, offset) -> the CRC-32 its writer computed


def encode(train: Any, metadata: Metadata, chunks: dict[str, dict[int, int]] | None = None) -> bytes:
    """`chunks`: file -> {offset: CRC-32} of this rank's chunks (none: readers check zips' own CRCs)."""
    crcs = {
        name: {str(offset): crc for offset, crc in by_offset.items()}
        for name, by_offset in (chunks or {}).items()
    }
    text = json.dumps({"train": train, "chunks": crcs}, separators=(",", ":")).encode()
    meta = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    digests = hashlib.sha256(text).digest() + hashlib.sha256(meta).digest()
    return MAGIC + _LENGTHS.pack(len(text), len(meta)) + digests + text + meta


@dataclass(frozen=True)
class _Header:
    text_bytes: int
    meta_bytes: int
    text_sha: bytes
    meta_sha: bytes

    @classmethod
    def parse(cls, data: bytes, where: str) -> _Header:
        if len(data) < HEADER_BYTES or not data.startswith(MAGIC):
            raise CheckpointDamaged(
                f"{where}: not a bigclip rank record (damaged header); resume from another checkpoint"
            )
        text_bytes, meta_bytes = _LENGTHS.unpack_from(data, len(MAGIC))
        digests = data[len(MAGIC) + _LENGTHS.size : HEADER_BYTES]
        return cls(text_bytes, meta_bytes, digests[:32], digests[32:])


def _read(location: Location, name: str, offset: int, size: int) -> bytes:
    buffer = bytearray(size)
    got = location.readinto(name, offset, memoryview(buffer))
    if got != size:
        raise CheckpointDamaged(
            f"{location.child_uri(name)} is shorter than its header says ({offset + got} bytes)"
        )
    return bytes(buffer)


def _checked(part: bytes, sha: bytes, where: str, what: str) -> bytes:
    if hashlib.sha256(part).digest() != sha:
        raise CheckpointDamaged(
            f"{where}: its {what} differs from what its writer recorded (SHA-256); the checkpoint is "
            "damaged: resume from another one"
        )
    return part


def _train_part(read: Callable[[int, int], bytes], where: str) -> tuple[_Header, bytes]:
    """A record's header and its JSON part, checked: `read(offset, size)` gives the record's bytes."""
    header = _Header.parse(read(0, HEADER_BYTES), where)
    text = _checked(read(HEADER_BYTES, header.text_bytes), header.text_sha, where, "training state")
    return header, text


def read_train(location: Location, folder: str, record: str) -> Any:
    """A saved rank's training state (its record's header and JSON part only: a ranged read)."""
    name = f"{folder}/{record}"
    _, text = _train_part(lambda offset, size: _read(location, name, offset, size), location.child_uri(name))
    return json.loads(text)["train"]


def read_metadata(location: Location, folder: str, record: str) -> tuple[Metadata, ChunkCrcs]:
    """A saved rank's DCP metadata (its own chunks and where they are stored) and its chunks'
    CRC-32s as written (empty for a record written before they were kept)."""
    name = f"{folder}/{record}"
    where = location.child_uri(name)
    data = location.read_bytes(name)
    header, text = _train_part(lambda offset, size: data[offset : offset + size], where)
    start = HEADER_BYTES + header.text_bytes
    meta = _checked(data[start : start + header.meta_bytes], header.meta_sha, where, "metadata")
    try:
        metadata = load_metadata(meta)
    except Exception as e:  # the restricted unpickler refused it: damage or tampering
        raise CheckpointDamaged(f"{where}: {e}") from e
    return metadata, {
        (file, offset): crc for file, by_offset in _crcs(text).items() for offset, crc in by_offset.items()
    }


def read_chunk_crcs(blobs: BlobFolder, record: str) -> dict[str, dict[int, int]]:
    """A saved rank's chunks' CRC-32s as written, file -> {offset: CRC-32} (its record's header and
    JSON part: ranged reads), for the readers of a whole checkpoint, which use DCP's .metadata."""
    _, text = _train_part(lambda offset, size: blobs.read(record, offset, size), blobs.uri(record))
    return _crcs(text)


def _crcs(text: bytes) -> dict[str, dict[int, int]]:
    """The JSON part's chunk CRC-32s, file -> {offset: CRC-32}."""
    chunks = json.loads(text).get("chunks") or {}
    return {
        file: {int(offset): crc for offset, crc in by_offset.items()} for file, by_offset in chunks.items()
    }
