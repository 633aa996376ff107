"""Outputs on S3 that appear whole or not at all (sinks.py), through boto3.

A multipart upload, completed only on commit and aborted on `abort`. s3torchconnector's
`S3Writer` cannot be used here: it has no abort, and dropping an unclosed one completes the
upload (observed with 1.5.0), so an interrupted write would publish a truncated object. An
output that must not replace another is committed with `If-None-Match: *`, and
`S3Location.create_exclusive` is a conditional PUT: the primitive behind immutable names and leases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from bigclip.errors import StorageError
from bigclip.storage.records import ObjectRecord
from bigclip.storage.s3 import S3Settings, boto3_client, split_s3_uri
from bigclip.storage.sinks import HashedSink

PART_BYTES = 64 << 20  # S3 parts: at least 5 MiB; 64 MiB allows objects up to 640 GB
PARTS_IN_FLIGHT = 3


class S3Sink(HashedSink):
    """A multipart upload: parts of PART_BYTES go up on a few threads while the caller writes."""

    def __init__(
        self, uri: str, *, settings: S3Settings, overwrite: bool, exists: Callable[[], bool]
    ) -> None:
        """`exists`: whether the object is there now (asked, and refused, unless `overwrite`)."""
        super().__init__(uri, overwrite=overwrite, exists=exists)
        self.bucket, self.key = split_s3_uri(uri)
        self.client = boto3_client(settings)
        self._buffer = bytearray()
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
                raise self._appeared() from e
            raise StorageError(f"writing {self.uri} failed ({method}): {e}") from e
