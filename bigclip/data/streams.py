"""Byte streams over shards: local files, or S3 objects streamed with ranged GETs.

S3 objects are never copied to local disk: `S3ObjectStream` reads the HTTP body as it
arrives. It can start at any byte (a `Range: bytes=N-` request), which is what lets a resumed
run continue mid-shard without downloading the consumed prefix, and it reopens the object at
the byte it had reached when a long-lived connection drops mid-shard (common at thousands of
concurrent streams), so a transient network error costs one request, not the shard.

One boto3 client per process (`storage.s3.boto3_client`; data workers make their own).
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO

from bigclip.errors import DataError
from bigclip.storage.s3 import S3Settings, boto3_client, is_s3, split_s3_uri

READ_BUFFER_BYTES = 1 << 20
S3_REOPEN_ATTEMPTS = 5


def _transient_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError
    from urllib3.exceptions import ProtocolError

    return (BotoConnectionError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError, ProtocolError)


class S3ObjectStream(io.RawIOBase):
    """Sequential reader of one S3 object from `start`; reopens at the current byte on dropped connections."""

    def __init__(self, url: str, *, start: int = 0, settings: S3Settings) -> None:
        super().__init__()
        self.url = url
        self.bucket, self.key = split_s3_uri(url)
        self.position = start
        self._client = boto3_client(settings)
        self._body: Any = None
        self._at_end = False

    def readable(self) -> bool:
        return True

    def _open(self) -> None:
        from botocore.exceptions import ClientError

        extra = {"Range": f"bytes={self.position}-"} if self.position else {}
        try:
            self._body = self._client.get_object(Bucket=self.bucket, Key=self.key, **extra)["Body"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":  # started at or past the end
                self._at_end = True
                return
            raise DataError(f"cannot read {self.url}: {e}") from e

    def readinto(self, buffer: Any) -> int:
        for attempt in range(S3_REOPEN_ATTEMPTS + 1):
            if self._at_end:
                return 0
            try:
                if self._body is None:
                    self._open()
                    if self._at_end:
                        return 0
                data = self._body.read(len(buffer))
                break
            except _transient_errors():
                self._close_body()
                if attempt == S3_REOPEN_ATTEMPTS:
                    raise
        n = len(data)
        buffer[:n] = data
        self.position += n
        if n == 0:
            self._at_end = True
        return n

    def _close_body(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None

    def close(self) -> None:
        self._close_body()
        super().close()


def open_shard(url: str, *, start: int = 0, s3: S3Settings | None = None) -> BinaryIO:
    """A buffered binary stream over a shard (local path or s3:// URI), positioned at byte `start`."""
    if is_s3(url):
        raw = S3ObjectStream(url, start=start, settings=s3 or S3Settings.resolve())
        return io.BufferedReader(raw, buffer_size=READ_BUFFER_BYTES)
    try:
        stream = open(url, "rb", buffering=READ_BUFFER_BYTES)  # noqa: SIM115 - the caller closes it
    except OSError as e:
        raise DataError(f"cannot open shard {url}: {e}") from e
    stream.seek(start)
    return stream
