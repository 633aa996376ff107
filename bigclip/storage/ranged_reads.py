"""Random-access reads of the objects in one folder of any location (`pread`, ranged GETs...).

Streaming readers (consolidation, `--pretrained`) fetch exactly the byte ranges they need, so a
tensor's bytes are read once and nothing is staged on local disk. A folder may be a plain
folder or a published checkpoint whose objects are stored under other keys (the registry's
content-addressed `objects/<sha256>`): `names` maps the logical file name to the stored one.
Every call opens its own reader, so reads may run in parallel threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

from bigclip.errors import StorageError
from bigclip.storage.locations import Location


class BlobFolder:
    """The objects of `folder` under `location`, read by (name, offset, length)."""

    def __init__(
        self, location: Location, folder: str = "", *, names: Mapping[str, str] | None = None
    ) -> None:
        self.location = location
        self.folder = folder.strip("/")
        self.names = dict(names) if names is not None else None

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
            got = self.location.readinto(self._relative(name), offset, buffer)
        except self.location.read_errors as e:
            raise StorageError(f"cannot read {self.uri(name)} at byte {offset}: {e}") from e
        if got != len(buffer):
            raise StorageError(
                f"{self.uri(name)} is truncated: wanted bytes [{offset}, {offset + len(buffer)}), "
                f"got {got}; the object is damaged"
            )
