"""An S3 prefix as a `Location` through boto3: what processes that fork, and their children, use.

s3torchconnector's CRT clients are torn down before every fork (it registers an at-fork
handler), and a training process forks data-loader workers (the training data's once per run,
evaluation's at each evaluation): a CRT request running in a background thread at that moment
fails or hangs. So what runs across
forks (`open_location(..., fork_safe=True)`: data shards read in the workers, the remote sync's
thread) reaches S3 through boto3, which forks leave alone: the client is looked up per process
on every use (`boto3_client`), so a location made before a fork works after it. Shards stream
with reconnects (s3_stream.py); whole files go up with boto3's managed multipart transfer;
`copy` is server-side (no bytes pass through this host). Checkpoint shards themselves are
written and read through s3torchconnector (s3_location.py), in the main thread.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from bigclip.errors import StorageError
from bigclip.storage.local_location import READ_BUFFER_BYTES
from bigclip.storage.s3 import S3Settings, boto3_client, join_s3_uri, split_s3_uri

if TYPE_CHECKING:
    from bigclip.storage.s3_sink import S3Sink

_DELETE_BATCH = 1000  # S3's DeleteObjects limit


class BotoS3Location:
    listable = True

    def __init__(
        self, uri: str, *, settings: S3Settings, max_attempts: int | None = None, fast_fail: bool = False
    ) -> None:
        """`max_attempts` per request: callers that retry on their own (the sync's rounds) want few;
        `fast_fail`: validation's client (two tries, short timeouts; see `boto3_client`)."""
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError

        self.bucket, key = split_s3_uri(uri)
        self.prefix = key.strip("/")
        self.uri = join_s3_uri(self.bucket, self.prefix).rstrip("/")
        self.settings = settings
        self.service = settings.service
        self._client_options = {"fast_fail": fast_fail, "max_attempts": max_attempts}
        self.client  # noqa: B018 (made now: a missing boto3 is named before any request)
        self.read_errors: tuple[type[BaseException], ...] = (OSError, ClientError, BotoCoreError, HTTPError)

    @property
    def client(self) -> Any:
        """This process's client (cached per process: a fork gets its own)."""
        return boto3_client(self.settings, **self._client_options)

    def _key(self, relative: str) -> str:
        relative = relative.strip("/")
        return f"{self.prefix}/{relative}" if self.prefix and relative else self.prefix or relative

    def child_uri(self, name: str) -> str:
        return join_s3_uri(self.bucket, self._key(name))

    def _call(self, what: str, relative: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except self.read_errors as e:
            raise StorageError(f"{what} {self.child_uri(relative)} failed: {_short(e)}") from e

    def _pages(self, relative: str, *, delimiter: str) -> Iterator[dict]:
        base = self._key(relative)
        base = f"{base}/" if base else ""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base, Delimiter=delimiter):
                yield base, page
        except self.read_errors as e:
            raise StorageError(f"listing {self.child_uri(relative)} failed: {_short(e)}") from e

    def list_folders(self, folder: str = "") -> list[str]:
        names = []
        for base, page in self._pages(folder, delimiter="/"):
            names += [p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(names)

    def list_files(self, folder: str) -> dict[str, int]:
        """Every object under `folder`, recursively, by path relative to it."""
        files = {}
        for base, page in self._pages(folder, delimiter=""):
            files.update({o["Key"][len(base) :]: o["Size"] for o in page.get("Contents", [])})
        return files

    def exists(self, relative: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(relative))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise StorageError(f"checking {self.child_uri(relative)} failed: {_short(e)}") from e

    def size(self, relative: str) -> int:
        response = self._call("reading", relative, self.client.head_object, Key=self._key(relative))
        return int(response["ContentLength"])

    def read_bytes(self, relative: str) -> bytes:
        return self._call("reading", relative, self.client.get_object, Key=self._key(relative))["Body"].read()

    def open_read(self, relative: str, *, start: int = 0) -> BinaryIO:
        """Streamed from byte `start`, reopened where it was on a dropped connection (s3_stream.py)."""
        from bigclip.storage.s3_stream import S3ObjectStream

        raw = S3ObjectStream(self.child_uri(relative), client=self.client, start=start)
        return io.BufferedReader(raw, buffer_size=READ_BUFFER_BYTES)

    def readinto(self, relative: str, offset: int, buffer: memoryview) -> int:
        if not len(buffer):
            return 0
        byte_range = f"bytes={offset}-{offset + len(buffer) - 1}"
        body = self._call(
            "reading", relative, self.client.get_object, Key=self._key(relative), Range=byte_range
        )
        return _read_all_into(body["Body"], buffer)

    def write_bytes(self, relative: str, data: bytes) -> None:
        # One PUT: readers see the old object, no object, or all of the new one.
        self._call("writing", relative, self.client.put_object, Key=self._key(relative), Body=data)

    def open_sink(self, relative: str, *, overwrite: bool) -> S3Sink:
        from bigclip.storage.s3_sink import S3Sink

        exists = not overwrite and self.exists(relative)
        return S3Sink(self.child_uri(relative), settings=self.settings, overwrite=overwrite, exists=exists)

    def create_exclusive(self, relative: str, data: bytes) -> bool:
        from bigclip.storage.s3_sink import s3_create_exclusive

        return s3_create_exclusive(self.child_uri(relative), data, settings=self.settings)

    def put_file(self, relative: str, path: Path) -> None:
        """Upload a local file (multipart above 64 MiB); the object appears whole when complete."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
        try:
            self.client.upload_file(str(path), self.bucket, self._key(relative), Config=config)
        except FileNotFoundError:
            raise
        except Exception as e:  # boto3 wraps client errors in S3UploadFailedError
            raise StorageError(f"uploading to {self.child_uri(relative)} failed: {_short(e)}") from e

    def copy(self, source: str, relative: str) -> None:
        """Server-side copy (managed: multipart above 5 GB); nothing passes through this host."""
        try:
            self.client.copy(
                {"Bucket": self.bucket, "Key": self._key(source)}, self.bucket, self._key(relative)
            )
        except Exception as e:  # ClientError, or the transfer manager's own wrappers
            raise StorageError(f"copying {self.child_uri(source)} failed: {_short(e)}") from e

    def delete(self, relative: str) -> None:
        self._call("deleting", relative, self.client.delete_object, Key=self._key(relative))

    def delete_folder(self, folder: str) -> None:
        """Every object under `folder` (sub-folders too): one LIST page and one DeleteObjects
        request per 1,000 objects, instead of a request per object."""
        keys = [self._key(f"{folder}/{name}") for name in self.list_files(folder)]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start : start + _DELETE_BATCH]]
            response = self._call(
                "deleting", folder, self.client.delete_objects, Delete={"Objects": batch, "Quiet": True}
            )
            # DeleteObjects answers 200 and lists the keys it could not delete (quiet: only those).
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"deleting {self.child_uri(folder)} failed for {len(errors)} of {len(batch)} objects, e.g. "
                    f"{join_s3_uri(self.bucket, first.get('Key', '?'))}: {first.get('Code', '')}: "
                    f"{first.get('Message', '')}"
                )

    def dcp_writer(self, folder: str, *, threads: int | None = None, world_size: int | None = None) -> Any:
        raise StorageError(f"{self.uri}: checkpoints are written through s3torchconnector (open the location "
                           "without fork_safe), not from a process that forks")  # fmt: skip

    def dcp_reader(self, folder: str) -> Any:
        """Resuming reads through s3torchconnector, in the main thread (see the module docstring)."""
        from bigclip.storage.s3_dcp import s3_dcp_reader

        return s3_dcp_reader(self.child_uri(folder), settings=self.settings)


def _read_all_into(stream: Any, buffer: memoryview) -> int:
    done = 0
    while done < len(buffer):
        data = stream.read(len(buffer) - done)
        if not data:
            break
        buffer[done : done + len(data)] = data
        done += len(data)
    return done


_BOTO_MESSAGE = re.compile(
    r"An error occurred \((\w+)\) when calling the \w+ operation(?: \(reached max retries: (\d+)\))?: (.*)"
)


def _short(error: BaseException) -> str:
    """botocore's message in one line: "NoSuchBucket: The specified bucket does not exist"."""
    response = getattr(error, "response", None)
    if isinstance(response, dict) and response.get("Error"):
        err = response["Error"]
        return f"{err.get('Code', '')}: {err.get('Message', '')}".strip(": ")
    text = str(error).splitlines()[0] if str(error) else ""
    found = _BOTO_MESSAGE.search(text)  # S3UploadFailedError wraps the ClientError's text
    if found:
        code, retries, message = found.groups()
        return f"{code}: {message}" + (f" (gave up after {retries} retries)" if retries else "")
    return f"{type(error).__name__}: {text}"
