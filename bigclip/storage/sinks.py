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

from typing import Protocol

from bigclip.storage.records import ObjectRecord


class Sink(Protocol):
    uri: str

    def write(self, data: bytes | bytearray | memoryview) -> None: ...
    def record(self) -> ObjectRecord: ...  # size and SHA-256 of what was written so far
    def commit(self) -> ObjectRecord: ...
    def abort(self) -> None: ...
