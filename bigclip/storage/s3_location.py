"""An S3 prefix as a `Location` (see locations.py), through s3torchconnector's CRT client.

All S3 traffic of checkpoints goes through s3torchconnector: DCP's `S3StorageWriter` /
`S3StorageReader` for sharded state, the same client for small objects; nothing is staged on
local disk. The DCP classes take no endpoint argument, so their `.fs` is replaced by one built
on our client (s3_dcp.py; endpoint and path-style addressing from `bigclip.storage.s3.S3Settings`).
Imported only when a location is on S3 (`open_location`), so local runs need no S3 library.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from s3torchconnector import S3Exception, S3ReaderConstructor, S3Writer
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from bigclip.errors import StorageError
from bigclip.storage.hashing import HashingFileSystem
from bigclip.storage.s3 import S3Settings, join_s3_uri, s3torch_client, split_s3_uri
from bigclip.storage.s3_boto import BotoS3Location
from bigclip.storage.s3_dcp import s3_dcp_reader, s3_dcp_writer


class S3Location:
    read_errors: tuple[type[BaseException], ...] = (OSError, S3Exception)

    def __init__(self, uri: str, *, settings: S3Settings, max_attempts: int | None = None) -> None:
        """`max_attempts` overrides the CRT client's retry budget (default 10, with back-off)."""
        self.bucket, key = split_s3_uri(uri)
        self.prefix = key.strip("/")
        self.uri = join_s3_uri(self.bucket, self.prefix).rstrip("/")
        self.settings = settings
        self.client = s3torch_client(settings, max_attempts=max_attempts)

    def _key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def child_uri(self, name: str) -> str:
        return join_s3_uri(self.bucket, self._key(name))

    def _list(self, prefix: str, delimiter: str) -> Iterator:
        try:
            yield from self.client.list_objects(self.bucket, prefix, delimiter)
        except S3Exception as e:  # raised lazily, while paging
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
        except S3Exception as e:
            if "not found" in str(e).lower():
                return False
            raise StorageError(f"cannot read {self.child_uri(relative)}: {e}") from e

    def read_bytes(self, relative: str) -> bytes:
        with self.open_read(relative) as stream:
            return stream.read()

    def open_read(self, relative: str) -> BinaryIO:
        reader = S3ReaderConstructor.sequential()
        return self.client.get_object(self.bucket, self._key(relative), reader_constructor=reader)

    def open_write(self, relative: str) -> S3Writer:
        """A streaming upload; the object appears, whole, when the stream closes without error."""
        return self.client.put_object(self.bucket, self._key(relative))

    def write_bytes(self, relative: str, data: bytes) -> None:
        # A PUT is atomic on S3: readers see the old object, no object, or all of the new one.
        with self.client.put_object(self.bucket, self._key(relative)) as stream:
            stream.write(data)

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
        keys = [f"{folder}/{name}" for name in self.list_files(folder)]
        # The CRT client has no batch delete; deletes are small, so a few threads suffice.
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(self.delete, keys))

    def dcp_writer(self, folder: str, *, threads: int) -> tuple[FileSystemWriter, HashingFileSystem]:
        return s3_dcp_writer(
            self.child_uri(folder), settings=self.settings, client=self.client, threads=threads
        )

    def dcp_reader(self, folder: str) -> FileSystemReader:
        return s3_dcp_reader(self.child_uri(folder), settings=self.settings, client=self.client)
