"""What bigclip records of every object it writes: its size and SHA-256.

Manifests (checkpoints, consolidated files, registry publications) hold an `Inventory`: an
`ObjectRecord` per object, by name; readers check what they read against it. Light on purpose
(no torch): shard tools and sinks import it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, BinaryIO

CHECKSUM_ALGORITHM = "sha256"


@dataclass(frozen=True)
class ObjectRecord:
    """One written object: its size and checksum."""

    size: int
    sha256: str


class Inventory(dict[str, ObjectRecord]):
    """name -> ObjectRecord: every object a manifest lists (a checkpoint's, a consolidation's, a
    publication's). Its JSON is {name: {"size": N, "sha256": HEX}}."""

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Inventory:
        return cls((name, ObjectRecord(**record)) for name, record in body.items())

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.values())

    def size_problems(
        self, sizes: Mapping[str, int | None], *, label: Callable[[str], str] = str
    ) -> list[str]:
        """Objects missing from `sizes` (name -> size found) or of another size there; cheap: one
        listing. `label` names an object in the lines."""
        problems = []
        for name, record in self.items():
            size = sizes.get(name)
            if size != record.size:
                state = "missing" if size is None else f"{size} bytes, manifest says {record.size}"
                problems.append(f"{label(name)}: {state}")
        return problems

    def checksum_problems(
        self,
        open_read: Callable[[str], AbstractContextManager[BinaryIO]],
        *,
        label: Callable[[str], str] = str,
        stored_as: Callable[[str], str] = str,
        read_bytes: Callable[[int], object] = lambda n: None,
    ) -> list[str]:
        """Re-read every object and compare it with its record, once per stored object
        (`stored_as`: names that share one, as a registry's content-addressed blobs, are read once);
        `read_bytes` is told each object's size as it is read (a progress bar)."""
        problems, seen = [], set()
        for name, record in self.items():
            if stored_as(name) in seen:
                continue
            seen.add(stored_as(name))
            hasher = Hasher()
            try:
                with open_read(name) as stream:
                    while chunk := stream.read(8 << 20):
                        hasher.update(chunk)
            except Exception as e:  # missing or unreadable: reported with the rest
                problems.append(f"{label(name)}: cannot read ({e})")
                continue
            actual = hasher.record()
            read_bytes(actual.size)
            if actual != record:
                problems.append(f"{label(name)}: content differs from the manifest (size {actual.size}, "
                                f"sha256 {actual.sha256[:12]}...)")  # fmt: skip
        return problems


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
