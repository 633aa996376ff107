"""The s3:// scheme: an S3 prefix as a `Location` (see locations.py), through s3torchconnector's CRT client.

All S3 traffic of checkpoints goes through s3torchconnector: DCP's `S3StorageWriter` /
`S3StorageReader` for sharded state, the same client for small objects and ranged reads;
nothing is staged on local disk. The DCP classes take no endpoint argument, so their `.fs` is
replaced by one built on our client (s3_dcp.py; endpoint and path-style addressing from
`bigclip.storage.s3.S3Settings`). Outputs that must appear whole (sinks, exclusive creation)
and uploads of local files go through boto3 (s3_sink.py, s3_boto.py). `open_s3`, the scheme's
opener (schemes.py), is imported only when an s3:// URI is opened, so local runs need no S3
library; with `fork_safe` it returns the boto3 location instead (s3_boto.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, BinaryIO

from bigclip.errors import StorageError
from bigclip.storage.s3 import S3Settings, join_s3_uri, require_s3_package, s3torch_client, split_s3_uri
from bigclip.storage.s3_boto import BotoS3Location
from bigclip.storage.s3_sink import S3Sink, s3_create_exclusive
from bigclip.storage.schemes import OpenOptions

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from bigclip.storage.hashing import HashingFileSystem
    from bigclip.storage.locations import Location


def open_s3(uri: str, options: OpenOptions) -> Location:
    """The s3:// scheme's opener: the CRT location, or the boto3 one for what runs across forks."""
    settings = S3Settings.resolve()
    if options.fork_safe:
        require_s3_package("boto3", uri=uri)
        return BotoS3Location(
            uri, settings=settings, max_attempts=options.max_attempts, fast_fail=options.fast_fail
        )
    require_s3_package("s3torchconnector", uri=uri)
    max_attempts = 2 if options.fast_fail and options.max_attempts is None else options.max_attempts
    return S3Location(uri, settings=settings, max_attempts=max_attempts)


class S3Location:
    listable = True

    def __init__(self, uri: str, *, settings: S3Settings, max_attempts: int | None = None) -> None:
        """`max_attempts` overrides the CRT client's retry budget (default 10, with back-off)."""
        from s3torchconnector import S3Exception

        self.bucket, key = split_s3_uri(uri)
        self.prefix = key.strip("/")
        self.uri = join_s3_uri(self.bucket, self.prefix).rstrip("/")
        self.settings = settings
        self.service = settings.service
        self.max_attempts = max_attempts
        self.client = s3torch_client(settings, max_attempts=max_attempts)
        self.read_errors: tuple[type[BaseException], ...] = (OSError, S3Exception)
        self._sizes: dict[str, int] = {}  # object sizes seen, so ranged reads skip a HEAD each

    def _key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def child_uri(self, name: str) -> str:
        return join_s3_uri(self.bucket, self._key(name))

    def _list(self, prefix: str, delimiter: str) -> Iterator:
        try:
            yield from self.client.list_objects(self.bucket, prefix, delimiter)
        except self.read_errors as e:  # raised lazily, while paging
            raise StorageError(f"cannot list {join_s3_uri(self.bucket, prefix)}: {e}") from e

    def list_folders(self) -> list[str]:
        base = self._key("")
        names = []
        for page in self._list(base, "/"):
            names += [p[len(base) :].rstrip("/") for p in page.common_prefixes]
        return sorted(names)

    def list_files(self, folder: str) -> dict[str, int]:
        """Every object under `folder`, recursively ("" lists the whole prefix)."""
        base = self._key(folder.strip("/")).rstrip("/")
        base = f"{base}/" if base else ""
        files = {}
        for page in self._list(base, ""):
            files.update({o.key[len(base) :]: o.size for o in page.object_info})
        return files

    def exists(self, relative: str) -> bool:
        try:
            self.client.head_object(self.bucket, self._key(relative))
            return True
        except self.read_errors as e:
            if "not found" in str(e).lower():
                return False
            raise StorageError(f"cannot read {self.child_uri(relative)}: {e}") from e

    def read_bytes(self, relative: str) -> bytes:
        with self.open_read(relative) as stream:
            return stream.read()

    def size(self, relative: str) -> int:
        if relative not in self._sizes:
            self._sizes[relative] = self.client.head_object(self.bucket, self._key(relative)).size
        return self._sizes[relative]

    def open_read(self, relative: str, *, start: int = 0) -> BinaryIO:
        from s3torchconnector import S3ReaderConstructor

        reader = S3ReaderConstructor.sequential()
        stream = self.client.get_object(self.bucket, self._key(relative), reader_constructor=reader)
        if start:
            stream.seek(start)
        return stream

    def readinto(self, relative: str, offset: int, buffer: memoryview) -> int:
        from s3torchconnector import S3ReaderConstructor

        # The ranged reader needs only `.size` of the object info it is given; passing the known
        # size saves one HEAD per read. No read-ahead buffer: callers ask for exactly the ranges
        # they use, often many MiB at once.
        reader = self.client.get_object(
            self.bucket,
            self._key(relative),
            object_info=SimpleNamespace(size=self.size(relative)),
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

    def write_bytes(self, relative: str, data: bytes) -> None:
        # A PUT is atomic on S3: readers see the old object, no object, or all of the new one.
        with self.client.put_object(self.bucket, self._key(relative)) as stream:
            stream.write(data)

    def open_sink(self, relative: str, *, overwrite: bool) -> S3Sink:
        exists = not overwrite and self.exists(relative)
        return S3Sink(self.child_uri(relative), settings=self.settings, overwrite=overwrite, exists=exists)

    def create_exclusive(self, relative: str, data: bytes) -> bool:
        return s3_create_exclusive(self.child_uri(relative), data, settings=self.settings)

    def put_file(self, relative: str, path: Path) -> None:
        self._boto().put_file(relative, path)

    def copy(self, source: str, relative: str) -> None:
        self._boto().copy(source, relative)

    def _boto(self) -> BotoS3Location:
        # Multipart uploads with abort-on-failure and server-side copies: boto3's managed transfers.
        return BotoS3Location(self.uri, settings=self.settings, max_attempts=None)

    def delete(self, relative: str) -> None:
        self.client.delete_object(self.bucket, self._key(relative))

    def delete_folder(self, folder: str) -> None:
        # The CRT client has no batch delete: boto3's DeleteObjects takes 1,000 keys a request.
        self._boto().delete_folder(folder)

    @cached_property
    def _write_client(self) -> Any:
        """The client checkpoints are written through: larger parts, so fewer requests per object."""
        from bigclip.storage.save_requests import PART_BYTES

        return s3torch_client(self.settings, max_attempts=self.max_attempts, part_size=PART_BYTES)

    def dcp_writer(
        self, folder: str, *, threads: int | None = None, world_size: int | None = None
    ) -> tuple[FileSystemWriter, HashingFileSystem]:
        """`threads`: objects per rank (None: by the bytes each rank writes); `world_size`: ranks
        writing (None: the process group's), one S3 prefix each (s3_dcp_writer.py)."""
        from bigclip.storage.s3_dcp import s3_dcp_writer

        return s3_dcp_writer(self.child_uri(folder), settings=self.settings, client=self._write_client,
                             threads=threads, world_size=world_size or _world_size())  # fmt: skip

    def dcp_reader(self, folder: str) -> FileSystemReader:
        from bigclip.storage.s3_dcp import s3_dcp_reader

        return s3_dcp_reader(self.child_uri(folder), settings=self.settings, client=self.client)


def _world_size() -> int:
    import torch.distributed as dist  # loaded already: a checkpoint is being written

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
