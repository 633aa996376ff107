"""Output objects that appear whole or not at all: streamed, hashed on the way, then committed.

    sink = location.open_sink("model.safetensors", overwrite=False)
    sink.write(b"..."); ...
    record = sink.commit()      # size + SHA-256; the object now exists under its name
    # or sink.abort()           # nothing appears; temporary data is removed

Each location kind implements it: a local folder (local_location.py: a temporary file, fsynced
and renamed or hard-linked on commit), S3 (s3_sink.py: a multipart upload, completed on commit
and aborted on abort) and fsspec filesystems (fsspec_location.py: a temporary object, moved on
commit). `location.create_exclusive` is its small sibling: an object written only if none
exists, atomically (the primitive behind immutable names and leases).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from bigclip.errors import StorageError
from bigclip.storage.records import Hasher, ObjectRecord


class Sink(Protocol):
    uri: str

    def write(self, data: bytes | bytearray | memoryview) -> None: ...
    def record(self) -> ObjectRecord: ...  # size and SHA-256 of what was written so far
    def commit(self) -> ObjectRecord: ...
    def abort(self) -> None: ...


class HashedSink:
    """What every location's sink shares: an existing target refused unless `overwrite` (`exists`
    is asked only then), the size and SHA-256 of what was written, and how a target that appeared
    during the write is reported."""

    def __init__(self, uri: str, *, overwrite: bool, exists: Callable[[], bool]) -> None:
        self.uri, self.overwrite = uri, overwrite
        if not overwrite and exists():
            raise StorageError(f"{uri} exists; pass --overwrite to replace it, or choose another name")
        self._hash = Hasher()

    def record(self) -> ObjectRecord:
        return self._hash.record()

    def _appeared(self) -> StorageError:
        return StorageError(f"{self.uri} appeared while it was written; nothing was replaced")
