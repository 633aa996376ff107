"""Where checkpoints live: a local folder or an S3 prefix, behind one small interface.

A `Location` is a root (a path or `s3://bucket/prefix`) that holds one sub-folder per
checkpoint. It knows how to list sub-folders and files, read and atomically write small
objects (the manifest), delete a checkpoint, and build DCP storage writers and readers.
The S3 implementation is in s3_location.py, imported only for an s3:// URI, so a run on local
files needs no S3 library. `open_location(uri, any_scheme=True)` also opens what bigclip only
reads or copies to: `file://` URLs and any other fsspec scheme (fsspec_location.py).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import BinaryIO, Protocol

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from bigclip.errors import StorageError
from bigclip.storage.hashing import HashingFileSystem
from bigclip.storage.s3 import S3Settings, is_s3, require_s3_package
from bigclip.storage.safe_metadata import SafeMetadataMixin


class Location(Protocol):
    uri: str
    read_errors: tuple[type[BaseException], ...]  # what a failed read raises, besides StorageError

    def child_uri(self, name: str) -> str: ...
    def list_folders(self) -> list[str]: ...
    def list_files(self, folder: str) -> dict[str, int]: ...
    def exists(self, relative: str) -> bool: ...
    def read_bytes(self, relative: str) -> bytes: ...
    def write_bytes(self, relative: str, data: bytes) -> None: ...
    def delete(self, relative: str) -> None: ...
    def delete_folder(self, folder: str) -> None: ...
    def open_read(self, relative: str) -> BinaryIO: ...
    def put_file(self, relative: str, path: Path) -> None: ...  # upload a local file, whole or not at all
    def copy(self, source: str, relative: str) -> None: ...  # within the location (server-side on S3)
    def dcp_writer(self, folder: str, *, threads: int) -> tuple[FileSystemWriter, HashingFileSystem]: ...
    def dcp_reader(self, folder: str) -> FileSystemReader: ...


def open_location(
    uri: str, *, s3: S3Settings | None = None, max_attempts: int | None = None, any_scheme: bool = False
) -> Location:
    """The Location for a local path or an s3:// URI; with `any_scheme`, also file:// and any
    fsspec scheme (read or copied to only: checkpoints are written locally or to S3)."""
    if is_s3(uri):
        require_s3_package("s3torchconnector", uri=uri)
        from bigclip.storage.s3_location import S3Location  # s3torchconnector: only for S3

        return S3Location(uri, settings=s3 or S3Settings.resolve(), max_attempts=max_attempts)
    if uri.startswith("file://"):
        return LocalLocation(uri[len("file://") :] or "/")
    if "://" in uri:
        if any_scheme:
            from bigclip.storage.fsspec_location import FsspecLocation

            return FsspecLocation(uri)
        raise StorageError(f"{uri!r}: checkpoint locations are local paths or s3://bucket/prefix URIs")
    return LocalLocation(uri)


class SafeFileSystemReader(SafeMetadataMixin, FileSystemReader):
    """DCP's local reader, reading `.metadata` with a restricted unpickler."""


class LocalLocation:
    read_errors: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().absolute()
        self.uri = str(self.root)

    def child_uri(self, name: str) -> str:
        return str(self.root / name)

    def list_folders(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def list_files(self, folder: str) -> dict[str, int]:
        path = self.root / folder
        if not path.is_dir():
            return {}
        files = {}
        for p in path.iterdir():
            try:
                if p.is_file():
                    files[p.name] = p.stat().st_size
            except FileNotFoundError:
                continue  # deleted while listed (a lease released, a temporary file renamed)
        return files

    def exists(self, relative: str) -> bool:
        return (self.root / relative).exists()

    def read_bytes(self, relative: str) -> bytes:
        return (self.root / relative).read_bytes()

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write, fsync, then rename into place (and fsync the folder): all or nothing."""
        target = self.root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)

    def delete(self, relative: str) -> None:
        (self.root / relative).unlink(missing_ok=True)

    def delete_folder(self, folder: str) -> None:
        shutil.rmtree(self.root / folder, ignore_errors=True)

    def open_read(self, relative: str) -> BinaryIO:
        return open(self.root / relative, "rb")

    def put_file(self, relative: str, path: Path) -> None:
        self._copy_in(Path(path), relative)

    def copy(self, source: str, relative: str) -> None:
        self._copy_in(self.root / source, relative)

    def _copy_in(self, source: Path, relative: str) -> None:
        """Copy to a hidden temporary name, fsync, rename: the target appears whole or not at all."""
        target = self.root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            shutil.copyfile(source, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(target.parent)

    def dcp_writer(self, folder: str, *, threads: int) -> tuple[FileSystemWriter, HashingFileSystem]:
        writer = FileSystemWriter(self.root / folder, sync_files=True, thread_count=threads)
        hashing = HashingFileSystem(FileSystem())
        writer.fs = hashing
        return writer, hashing

    def dcp_reader(self, folder: str) -> FileSystemReader:
        return SafeFileSystemReader(self.root / folder)


def fsync_dir(path: Path) -> None:
    """Make a rename or link in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
