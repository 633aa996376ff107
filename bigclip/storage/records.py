"""What bigclip records of every object it writes: its size and SHA-256.

Manifests (checkpoints, consolidated files, registry publications) list an `ObjectRecord` per
object; readers check what they read against it. Light on purpose (no torch): shard tools and
sinks import it.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

CHECKSUM_ALGORITHM = "sha256"


@dataclass(frozen=True)
class ObjectRecord:
    """One written object: its size and checksum."""

    size: int
    sha256: str


class Hasher:
    """Size and SHA-256 of the bytes passed to `update`, so far."""

    def __init__(self) -> None:
        self.digest = hashlib.new(CHECKSUM_ALGORITHM)
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.digest.update(data)
        self.size += len(data)

    def record(self) -> ObjectRecord:
        return ObjectRecord(size=self.size, sha256=self.digest.hexdigest())


def sha256_of_stream(stream: io.IOBase, *, chunk_bytes: int = 8 << 20) -> ObjectRecord:
    """Size and checksum of everything readable from `stream` (used by explicit verification)."""
    hasher = Hasher()
    while chunk := stream.read(chunk_bytes):
        hasher.update(chunk)
    return hasher.record()
