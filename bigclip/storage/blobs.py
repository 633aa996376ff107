"""Random-access reads of the objects in one folder: local files (`pread`) or S3 (ranged GETs).

Streaming readers (consolidation, `--pretrained`) fetch exactly the byte ranges they need, so a
tensor's bytes are read once and nothing is staged on local disk. A folder may be a plain
folder or a published checkpoint whose objects are stored under other keys (the registry's
content-addressed `objects/<sha256>`): `names` maps the logical file name to the stored one.
Every call opens its own reader, so reads may run in parallel threads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

from bigclip.errors import StorageError
from bigclip.storage.locations import LocalLocation, Location
from bigclip.storage.s3 import is_s3, split_s3_uri


class BlobFolder:
    """The objects of `folder` under `location`, read by (name, offset, length)."""

    def __init__(
        self, location: Location, folder: str = "", *, names: Mapping[str, str] | None = None
    ) -> None:
        self.location = location
        self.folder = folder.strip("/")
        self.names = dict(names) if names is not None else None
        self._sizes: dict[str, int] = {}  # object sizes seen, so ranged S3 reads skip a HEAD each

    def _relative(self, name: str) -> str:
        stored = self.names.get(name, name) if self.names is not None else name
        return f"{self.folder}/{stored}" if self.folder else stored

    def uri(self, name: str) -> str:
        """Where `name` is stored (for messages; a mapped object also shows its logical name)."""
        uri = self.location.child_uri(self._relative(name))
        return f"{uri} ({name})" if self.names is not None else uri

    @cached_property
    def _listing(self) -> dict[str, int]:
        if self.names is not None:
            return {}  # sizes of mapped objects come from their manifest, never from a listing
        return self.location.list_files(self.folder)

    def sizes(self) -> dict[str, int]:
        """Size of every object in the folder (one LIST; not available for mapped folders)."""
        return dict(self._listing)

    def exists(self, name: str) -> bool:
        return self.location.exists(self._relative(name))

    def read_all(self, name: str) -> bytes:
        try:
            return self.location.read_bytes(self._relative(name))
        except self.location.read_errors as e:
            raise StorageError(f"cannot read {self.uri(name)}: {e}") from e

    def read(self, name: str, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.readinto(name, offset, memoryview(buffer))
        return bytes(buffer)

    def readinto(self, name: str, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the object's bytes [offset, offset + len(buffer)); short objects raise."""
        try:
            got = self._readinto(self._relative(name), offset, buffer)
        except self.location.read_errors as e:
            raise StorageError(f"cannot read {self.uri(name)} at byte {offset}: {e}") from e
        if got != len(buffer):
            raise StorageError(
                f"{self.uri(name)} is truncated: wanted bytes [{offset}, {offset + len(buffer)}), "
                f"got {got}; the object is damaged"
            )

    def _readinto(self, relative: str, offset: int, buffer: memoryview) -> int:
        if isinstance(self.location, LocalLocation):
            return _pread_all(Path(self.location.root) / relative, offset, buffer)
        if is_s3(self.location.uri):
            return self._ranged_get(relative, offset, buffer)
        raise StorageError(f"{self.location.uri}: ranged reads need a local folder or an s3:// prefix")

    def _ranged_get(self, relative: str, offset: int, buffer: memoryview) -> int:
        from s3torchconnector import S3ReaderConstructor

        bucket, key = split_s3_uri(self.location.child_uri(relative))
        client = self.location.client
        if relative not in self._sizes:
            self._sizes[relative] = client.head_object(bucket, key).size
        # The ranged reader needs only `.size` of the object info it is given; passing the known
        # size saves one HEAD per read. No read-ahead buffer: callers ask for exactly the ranges
        # they use, often many MiB at once.
        reader = client.get_object(
            bucket,
            key,
            object_info=SimpleNamespace(size=self._sizes[relative]),
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


def _pread_all(path: Path, offset: int, buffer: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(buffer):
            n = os.preadv(fd, [buffer[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done
    finally:
        os.close(fd)
