"""One S3 object read front to back from any byte, surviving dropped connections (boto3).

Objects are never copied to local disk: `S3ObjectStream` reads the HTTP body as it arrives. It
can start at any byte (a `Range: bytes=N-` request), which is what lets a resumed run continue
mid-shard without downloading the consumed prefix, and it reopens the object at the byte it had
reached when a long-lived connection drops mid-object (common at thousands of concurrent
streams), so a transient network error costs one request, not the object. boto3, not the CRT
client: data workers are forked processes, and each makes its own boto3 client (s3.boto3_client).
"""

from __future__ import annotations

import io
from typing import Any

from bigclip.errors import StorageError
from bigclip.storage.s3 import split_s3_uri

REOPEN_ATTEMPTS = 5


def transient_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError
    from urllib3.exceptions import ProtocolError

    return (BotoConnectionError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError, ProtocolError)


class S3ObjectStream(io.RawIOBase):
    """Sequential reader of one S3 object from `start`; reopens at the current byte on dropped connections."""

    def __init__(self, url: str, *, client: Any, start: int = 0) -> None:
        super().__init__()
        self.url = url
        self.bucket, self.key = split_s3_uri(url)
        self.position = start
        self._client = client
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
            raise StorageError(f"cannot read {self.url}: {e}") from e

    def readinto(self, buffer: Any) -> int:
        for attempt in range(REOPEN_ATTEMPTS + 1):
            if self._at_end:
                return 0
            try:
                if self._body is None:
                    self._open()
                    if self._at_end:
                        return 0
                data = self._body.read(len(buffer))
                break
            except transient_errors():
                self._close_body()
                if attempt == REOPEN_ATTEMPTS:
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
