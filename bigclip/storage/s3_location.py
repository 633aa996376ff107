"""The s3:// scheme: an S3 prefix as a `Location` (see locations.py).

Two clients, each where it is strong:
- boto3 for listings, small objects, sinks, uploads, copies and deletes. Its client is looked up
  per process on every use (`boto3_client`), so a location made before a fork works after it:
  data workers and the remote sync's thread use it too. Whole files go up with boto3's managed
  multipart transfer, `copy` is server-side (no bytes pass through this host), streams reopen
  where they were on a dropped connection (s3_stream.py), and a folder is deleted 1,000 keys a
  request.
- s3torchconnector's CRT client for checkpoint shards: DCP's writer and reader (s3_dcp.py) and
  the ranged reads of consolidation and verification, in the main thread, never staged on disk.
  Its clients are torn down before every fork (it registers an at-fork handler), and a training
  process forks data workers, so a location opened `fork_safe` never makes one: its ranged
  reads go through boto3 and it refuses to write a checkpoint.
`open_s3`, the scheme's opener (schemes.py), is imported only when an s3:// URI is opened, so local
runs need no S3 library.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, BinaryIO

from bigclip.errors import StorageError
from bigclip.storage.local_location import READ_BUFFER_BYTES
from bigclip.storage.s3 import (
    S3Settings,
    boto3_client,
    join_s3_uri,
    require_s3_package,
    s3torch_client,
    split_s3_uri,
)
from bigclip.storage.schemes import OpenOptions

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from bigclip.storage.hashing import HashingFileSystem
    from bigclip.storage.locations import Location
    from bigclip.storage.s3_sink import S3Sink

_DELETE_BATCH = 1000  # S3's DeleteObjects limit


def open_s3(uri: str, options: OpenOptions) -> Location:
    """The s3:// scheme's opener (a missing boto3 or s3torchconnector is named now, not mid-run)."""
    if not options.fork_safe:
        require_s3_package("s3torchconnector", uri=uri)
    require_s3_package("boto3", uri=uri)
    return S3Location(uri, settings=S3Settings.resolve(), max_attempts=options.max_attempts,
                      fast_fail=options.fast_fail, fork_safe=options.fork_safe)  # fmt: skip


class S3Location:
    listable = True

    def __init__(
        self,
        uri: str,
        *,
        settings: S3Settings,
        max_attempts: int | None = None,
        fast_fail: bool = False,
        fork_safe: bool = False,
    ) -> None:
        """`max_attempts` per request (None: `configured_attempts()`): callers that retry on their
        own (the sync's rounds) want few; `fast_fail`: validation's clients (two tries, short
        timeouts); `fork_safe`: used across forks, so no CRT client (module docstring)."""
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError

        self.bucket, key = split_s3_uri(uri)
        self.prefix = key.strip("/")
        self.uri = join_s3_uri(self.bucket, self.prefix).rstrip("/")
        self.settings = settings
        self.service = settings.service
        self.max_attempts = 2 if fast_fail and max_attempts is None else max_attempts
        self.fork_safe = fork_safe
        self._client_options = {"fast_fail": fast_fail, "max_attempts": max_attempts}
        self.read_errors: tuple[type[BaseException], ...] = (OSError, ClientError, BotoCoreError, HTTPError)
        if not fork_safe:  # what the CRT client's ranged reads raise
            from s3torchconnector import S3Exception

            self.read_errors += (S3Exception,)
        self._sizes: dict[str, int] = {}  # checkpoint objects' sizes, so ranged reads skip a HEAD each

    @property
    def client(self) -> Any:
        """This process's boto3 client (cached per process: a fork gets its own)."""
        return boto3_client(self.settings, **self._client_options)

    @cached_property
    def crt_client(self) -> Any:
        """The s3torchconnector client checkpoint shards are read through (made on first use)."""
        if self.fork_safe:
            raise StorageError(f"{self.uri}: opened fork_safe, so it has no s3torchconnector client")
        return s3torch_client(self.settings, max_attempts=self.max_attempts)

    @cached_property
    def _crt_write_client(self) -> Any:
        """The client checkpoints are written through: larger parts, so fewer requests per object."""
        from bigclip.storage.save_requests import PART_BYTES

        return s3torch_client(self.settings, max_attempts=self.max_attempts, part_size=PART_BYTES)

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

    def _pages(self, relative: str, *, delimiter: str) -> Iterator[tuple[str, dict]]:
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
        """Every object under `folder`, recursively, by path relative to it ("": the whole prefix)."""
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
        if self.fork_safe:
            byte_range = f"bytes={offset}-{offset + len(buffer) - 1}"
            body = self._call(
                "reading", relative, self.client.get_object, Key=self._key(relative), Range=byte_range
            )
            return _read_all_into(body["Body"], buffer)
        return self._crt_readinto(relative, offset, buffer)

    def _crt_readinto(self, relative: str, offset: int, buffer: memoryview) -> int:
        from s3torchconnector import S3ReaderConstructor

        # The ranged reader needs only `.size` of the object info it is given; passing the known
        # size saves one HEAD per read. No read-ahead buffer: callers ask for exactly the ranges
        # they use, often many MiB at once.
        reader = self.crt_client.get_object(
            self.bucket,
            self._key(relative),
            object_info=SimpleNamespace(size=self._checkpoint_object_size(relative)),
            reader_constructor=S3ReaderConstructor.range_based(0),
        )
        reader.seek(offset)
        done = 0
        while done < len(buffer):
            n = reader.readinto(buffer[done:])
            if not n:
                break
            done += n
        return done

    def _checkpoint_object_size(self, relative: str) -> int:
        # Checkpoint objects never change once written: one HEAD per object, not one per read.
        if relative not in self._sizes:
            self._sizes[relative] = self.size(relative)
        return self._sizes[relative]

    def write_bytes(self, relative: str, data: bytes) -> None:
        # One PUT: readers see the old object, no object, or all of the new one.
        self._call("writing", relative, self.client.put_object, Key=self._key(relative), Body=data)

    def open_sink(self, relative: str, *, overwrite: bool) -> S3Sink:
        from bigclip.storage.s3_sink import S3Sink

        return S3Sink(self.child_uri(relative), settings=self.settings, overwrite=overwrite,
                      exists=lambda: self.exists(relative))  # fmt: skip

    def create_exclusive(self, relative: str, data: bytes) -> bool:
        """Write a small object only if it does not exist; False if it does (a conditional PUT)."""
        try:
            boto3_client(self.settings).put_object(
                Bucket=self.bucket, Key=self._key(relative), Body=data, IfNoneMatch="*"
            )
        except Exception as e:
            if "PreconditionFailed" in str(e) or "ConditionalRequestConflict" in str(e):
                return False
            raise StorageError(f"writing {self.child_uri(relative)} failed: {e}") from e
        return True

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

    def dcp_writer(
        self, folder: str, *, threads: int | None = None, world_size: int | None = None
    ) -> tuple[FileSystemWriter, HashingFileSystem]:
        """`threads`: objects per rank (None: by the bytes each rank writes); `world_size`: ranks
        writing (None: the process group's), one S3 prefix each (s3_dcp_writer.py)."""
        if self.fork_safe:
            raise StorageError(f"{self.uri}: checkpoints are written through s3torchconnector (open the "
                               "location without fork_safe), not from a process that forks")  # fmt: skip
        from bigclip.storage.s3_dcp import s3_dcp_writer

        return s3_dcp_writer(self.child_uri(folder), settings=self.settings, client=self._crt_write_client,
                             threads=threads, world_size=world_size or _world_size())  # fmt: skip

    def dcp_reader(self, folder: str) -> FileSystemReader:
        """Resuming reads through s3torchconnector, in the main thread (see the module docstring)."""
        from bigclip.storage.s3_dcp import s3_dcp_reader

        client = None if self.fork_safe else self.crt_client
        return s3_dcp_reader(self.child_uri(folder), settings=self.settings, client=client)


def _world_size() -> int:
    import torch.distributed as dist  # loaded already: a checkpoint is being written

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
