"""An S3 prefix as a `Location` through boto3, for background threads of processes that fork.

s3torchconnector's CRT clients are torn down before every fork (it registers an at-fork
handler), and a training process forks its data-loader workers at each epoch start: a CRT
request running in a background thread at that moment fails or hangs. The remote sync
(`bigclip.train.remote_sync`) is such a thread, so it reaches S3 through boto3, which forks
leave alone (each process builds its own client; see `boto3_client`). Whole files go up with
boto3's managed multipart transfer; `copy` is server-side (no bytes pass through this host).
Checkpoint shards themselves are still written and read through s3torchconnector
(s3_location.py), in the main thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from bigclip.errors import StorageError
from bigclip.storage.s3 import S3Settings, boto3_client, join_s3_uri, split_s3_uri

_DELETE_BATCH = 1000  # S3's DeleteObjects limit


class BotoS3Location:
    def __init__(self, uri: str, *, settings: S3Settings, max_attempts: int | None = 3) -> None:
        """`max_attempts` per request: callers that retry on their own (the sync's rounds) want few."""
        from botocore.exceptions import BotoCoreError, ClientError

        self.bucket, key = split_s3_uri(uri)
        self.prefix = key.strip("/")
        self.uri = join_s3_uri(self.bucket, self.prefix).rstrip("/")
        self.settings = settings
        self.client = boto3_client(settings, max_attempts=max_attempts)
        self.read_errors: tuple[type[BaseException], ...] = (OSError, ClientError, BotoCoreError)

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

    def read_bytes(self, relative: str) -> bytes:
        with self.open_read(relative) as stream:
            return stream.read()

    def open_read(self, relative: str) -> BinaryIO:
        return self._call("reading", relative, self.client.get_object, Key=self._key(relative))["Body"]

    def write_bytes(self, relative: str, data: bytes) -> None:
        # One PUT: readers see the old object, no object, or all of the new one.
        self._call("writing", relative, self.client.put_object, Key=self._key(relative), Body=data)

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
        keys = [self._key(f"{folder}/{name}") for name in self.list_files(folder)]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start : start + _DELETE_BATCH]]
            self._call(
                "deleting", folder, self.client.delete_objects, Delete={"Objects": batch, "Quiet": True}
            )

    def dcp_reader(self, folder: str) -> Any:
        """Resuming reads through s3torchconnector, in the main thread (see the module docstring)."""
        from bigclip.storage.s3_dcp import s3_dcp_reader

        return s3_dcp_reader(self.child_uri(folder), settings=self.settings)


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
