"""Output objects that appear whole or not at all: streamed, hashed on the way, then committed.

    sink = open_sink(location, "model.safetensors", overwrite=False)
    sink.write(b"..."); ...
    record = sink.commit()      # size + SHA-256; the object now exists under its name
    # or sink.abort()           # nothing appears; temporary data is removed

Local: bytes go to a hidden temporary file beside the target, which is fsynced and renamed
(or hard-linked, to refuse an existing target atomically) only on commit. S3: a multipart
upload through boto3, completed only on commit and aborted on `abort`. s3torchconnector's
`S3Writer` cannot be used here: it has no abort, and dropping an unclosed one completes the
upload (observed with 1.5.0), so an interrupted write would publish a truncated object.
`create_exclusive` writes a small object only if none exists (link(2) locally, a conditional
`If-None-Match: *` PUT on S3): the primitive behind immutable names and leases.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from bigclip.errors import StorageError
from bigclip.storage.hashing import ObjectRecord
from bigclip.storage.locations import LocalLocation, Location, fsync_dir
from bigclip.storage.s3 import boto3_client, is_s3, split_s3_uri

if TYPE_CHECKING:
    from bigclip.storage.s3_location import S3Location

PART_BYTES = 64 << 20  # S3 parts: at least 5 MiB; 64 MiB allows objects up to 640 GB
PARTS_IN_FLIGHT = 3


class Sink(Protocol):
    uri: str

    def write(self, data: bytes | bytearray | memoryview) -> None: ...
    def record(self) -> ObjectRecord: ...  # size and SHA-256 of what was written so far
    def commit(self) -> ObjectRecord: ...
    def abort(self) -> None: ...


def open_sink(location: Location, relative: str, *, overwrite: bool) -> Sink:
    if isinstance(location, LocalLocation):
        return LocalSink(Path(location.root) / relative, overwrite=overwrite)
    if is_s3(location.uri):
        return S3Sink(location, relative, overwrite=overwrite)
    raise StorageError(f"{location.uri}: outputs go to a local folder or an s3:// prefix")


class _Hasher:
    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.digest.update(data)
        self.size += len(data)

    def record(self) -> ObjectRecord:
        return ObjectRecord(size=self.size, sha256=self.digest.hexdigest())


class LocalSink:
    def __init__(self, target: Path, *, overwrite: bool) -> None:
        self.target, self.overwrite, self.uri = target, overwrite, str(target)
        if not overwrite and target.exists():
            raise StorageError(f"{target} exists; pass --overwrite to replace it, or choose another name")
        target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = target.with_name(f".{target.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
        self._file = open(self.tmp, "wb")  # noqa: SIM115 (closed by commit or abort)
        self._hash = _Hasher()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self._file.write(data)

    def record(self) -> ObjectRecord:
        return self._hash.record()

    def commit(self) -> ObjectRecord:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        try:
            if self.overwrite:
                os.replace(self.tmp, self.target)
            else:
                os.link(self.tmp, self.target)  # fails if the target appeared meanwhile
                self.tmp.unlink()
        except FileExistsError as e:
            self.abort()
            raise StorageError(f"{self.target} appeared while it was written; nothing was replaced") from e
        fsync_dir(self.target.parent)
        return self._hash.record()

    def abort(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)


class S3Sink:
    """A multipart upload: parts of PART_BYTES go up on a few threads while the caller writes."""

    def __init__(self, location: S3Location, relative: str, *, overwrite: bool) -> None:
        self.uri = location.child_uri(relative)
        self.bucket, self.key = split_s3_uri(self.uri)
        self.overwrite = overwrite
        if not overwrite and location.exists(relative):
            raise StorageError(f"{self.uri} exists; pass --overwrite to replace it, or choose another name")
        self.client = boto3_client(location.settings)
        self._buffer = bytearray()
        self._hash = _Hasher()
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="bigclip-upload")

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self._buffer += data
        while len(self._buffer) >= PART_BYTES:
            part = bytes(self._buffer[:PART_BYTES])
            del self._buffer[:PART_BYTES]
            self._send(part)

    def record(self) -> ObjectRecord:
        return self._hash.record()

    def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload", Bucket=self.bucket, Key=self.key)[
                "UploadId"
            ]
        in_flight = [f for f in self._parts if not f.done()]
        if len(in_flight) >= PARTS_IN_FLIGHT:
            in_flight[0].result()  # bounded memory: wait for the oldest part
        number = len(self._parts) + 1
        self._parts.append(self._pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: bytes) -> dict[str, Any]:
        response = self._call(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=part,
        )
        return {"PartNumber": number, "ETag": response["ETag"]}

    def commit(self) -> ObjectRecord:
        condition = {} if self.overwrite else {"IfNoneMatch": "*"}
        try:
            if self._upload_id is None:  # small: one PUT, atomic by itself
                self._call(
                    "put_object", Bucket=self.bucket, Key=self.key, Body=bytes(self._buffer), **condition
                )
            else:
                if self._buffer:
                    self._send(bytes(self._buffer))
                parts = [f.result() for f in self._parts]
                self._call("complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                           UploadId=self._upload_id, MultipartUpload={"Parts": parts}, **condition)  # fmt: skip
        except BaseException:
            self.abort()
            raise
        self._pool.shutdown()
        return self._hash.record()

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._buffer = bytearray()
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # best effort: a lifecycle rule reaps what remains
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
            self._upload_id = None

    def _call(self, method: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, method)(**kwargs)
        except Exception as e:
            if "PreconditionFailed" in str(e):
                raise StorageError(f"{self.uri} appeared while it was written; nothing was replaced") from e
            raise StorageError(f"writing {self.uri} failed ({method}): {e}") from e


def create_exclusive(location: Location, relative: str, data: bytes) -> bool:
    """Write a small object only if `relative` does not exist; False if it does (atomic)."""
    if isinstance(location, LocalLocation):
        target = Path(location.root) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        tmp.write_bytes(data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        fsync_dir(target.parent)
        return True
    if is_s3(location.uri):
        bucket, key = split_s3_uri(location.child_uri(relative))
        try:
            boto3_client(location.settings).put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except Exception as e:
            if "PreconditionFailed" in str(e) or "ConditionalRequestConflict" in str(e):
                return False
            raise StorageError(f"writing {location.child_uri(relative)} failed: {e}") from e
        return True
    raise StorageError(f"{location.uri}: expected a local folder or an s3:// prefix")
