"""Where objects live, behind one interface: a `Location` opened from a URI.

    location = open_location("s3://bucket/runs")          # or a path, file://, gs://, memory://...
    location.list_files("step_00000100"); location.open_read("00000.tar", start=4096)
    parent, name = open_parent("s3://bucket/data/00000.tar")

A `Location` is a root (a folder, an S3 prefix, a URL) holding objects under relative names.
Everything in bigclip that reads or writes objects (data shards and their sizes.json, weights,
checkpoints, the registry, remote sync, demo data) goes through it; only `bigclip/storage/`
knows schemes and their settings. A URI's scheme picks the opener (schemes.py); local paths
need no library at all, and each scheme's libraries are imported when its first URI is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from bigclip.errors import ConfigError, StorageError
from bigclip.storage.local_location import LocalLocation
from bigclip.storage.schemes import OpenOptions, is_local, local_path, opener_for, scheme_of

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from bigclip.storage.hashing import HashingFileSystem
    from bigclip.storage.sinks import Sink

__all__ = ["FSSPEC", "LocalLocation", "Location", "open_location", "open_parent"]

FSSPEC = "fsspec"  # `protocol=` that opens a URI through fsspec's filesystem for its scheme


class Location(Protocol):
    """The storage contract (docs/architecture.md). Names are relative to the root, '/'-separated."""

    uri: str
    read_errors: tuple[type[BaseException], ...]  # what a failed read raises, besides StorageError
    service: str  # who serves it, for messages ("S3 endpoint ..."; "" for a local folder)
    listable: bool  # False: a URL location, whose objects can only be downloaded by name

    def child_uri(self, name: str) -> str: ...
    def list_folders(self) -> list[str]: ...
    def list_files(self, folder: str) -> dict[str, int]: ...  # name -> size
    def exists(self, relative: str) -> bool: ...
    def size(self, relative: str) -> int: ...
    def read_bytes(self, relative: str) -> bytes: ...
    def open_read(self, relative: str, *, start: int = 0) -> BinaryIO: ...  # streamed, from byte `start`
    def readinto(self, relative: str, offset: int, buffer: memoryview) -> int: ...  # a ranged read
    def write_bytes(self, relative: str, data: bytes) -> None: ...  # whole or not at all
    def open_sink(self, relative: str, *, overwrite: bool) -> Sink: ...  # a large output, committed
    def create_exclusive(self, relative: str, data: bytes) -> bool: ...  # False if it exists (atomic)
    def put_file(self, relative: str, path: Path) -> None: ...  # upload a local file, whole or not at all
    def copy(self, source: str, relative: str) -> None: ...  # within the location (server-side on S3)
    def delete(self, relative: str) -> None: ...
    def delete_folder(self, folder: str) -> None: ...
    # threads: objects per rank (None: the location's choice); world_size: ranks writing (S3 gives
    # each its own key prefix; see s3_dcp_writer.py). The writer's `prefix_strategy(rank)`, when it
    # has one, is where rank R's objects go under `folder` (otherwise `__R_`, DCP's default).
    def dcp_writer(
        self, folder: str, *, threads: int | None = None, world_size: int | None = None
    ) -> tuple[FileSystemWriter, HashingFileSystem]: ...
    def dcp_reader(self, folder: str) -> FileSystemReader: ...


def open_location(
    uri: str,
    *,
    max_attempts: int | None = None,
    fast_fail: bool = False,
    fork_safe: bool = False,
    any_scheme: bool = False,
    protocol: str = "",
) -> Location:
    """The Location for a local path, a file:// URL or a registered scheme's URI (schemes.py).

    any_scheme: also any other fsspec scheme (gs://, az://, hf://...), for what bigclip only reads
        or copies to; checkpoints, shards and registries need a registered scheme.
    protocol: "" opens the URI's own scheme; a scheme name refuses URIs of another one
        (ConfigError); "fsspec" opens any URI with a scheme through fsspec's filesystem for it.
    The other options: see schemes.OpenOptions.
    """
    options = OpenOptions(max_attempts=max_attempts, fast_fail=fast_fail, fork_safe=fork_safe)
    scheme = scheme_of(uri)
    if protocol and protocol not in (FSSPEC, scheme):
        raise ConfigError(f"{uri!r} is not a {protocol}:// URI")
    if is_local(uri):
        return LocalLocation(local_path(uri))
    opener = opener_for(scheme) if protocol != FSSPEC else None
    if opener is not None:
        return opener(uri, options)
    if any_scheme or protocol == FSSPEC:
        from bigclip.storage.fsspec_location import FsspecLocation

        return FsspecLocation(uri, options)
    raise StorageError(
        f"{uri!r}: no storage scheme {scheme!r} is registered; checkpoints, shards and registries live in a "
        "local folder, s3://, or a scheme registered with bigclip.storage.schemes.register_scheme "
        "(see docs/extending.md)"
    )


def open_parent(uri: str, *, fork_safe: bool = False, any_scheme: bool = False) -> tuple[Location, str]:
    """(the location of the folder holding `uri`, the object's name there); options as for
    `open_location`."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    if not parent and is_local(uri):
        parent = "/" if uri.startswith("/") else "."
    return open_location(parent, fork_safe=fork_safe, any_scheme=any_scheme), name
