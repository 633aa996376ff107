"""Any fsspec filesystem as a `Location`: gs://, az://, abfs://, hf://, memory://, ...

Two uses. Opened for a scheme nobody registered (`open_location(uri, any_scheme=True)`, or
`protocol="fsspec"`), it serves what bigclip only reads or copies to: registry sources,
remote-sync targets, resuming from a remote copy. Registered as a scheme's opener
(`register_scheme("gs", FsspecLocation)`), it serves everything, checkpoints, shards and
registries included: registering is the statement that the filesystem keeps the storage
contract (an object appears whole when its stream closes; `open(path, "xb")` creates only if
absent). Checkpoints are written by torch's `FsspecWriter`, hashed on the way (dcp_files.py).
The filesystem package a scheme needs (gcsfs, adlfs, huggingface_hub...) is imported by fsspec
on first use; when it is missing the error names it, in seconds, before anything is copied.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from bigclip.errors import StorageError
from bigclip.storage.local_location import READ_BUFFER_BYTES
from bigclip.storage.records import ObjectRecord
from bigclip.storage.schemes import OpenOptions, scheme_of
from bigclip.storage.sinks import HashedSink

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from bigclip.storage.hashing import HashingFileSystem


def filesystem_for(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, root path) for `uri`; StorageError naming the package to install."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri)
    except ImportError as e:
        scheme = scheme_of(uri)
        raise StorageError(
            f"{uri}: the {scheme}:// filesystem is not installed ({e}); install that package "
            f"(gs:// gcsfs, az:// and abfs:// adlfs, hf:// huggingface_hub) and retry"
        ) from e
    except ValueError as e:
        raise StorageError(f"{uri}: no filesystem handles this scheme ({e})") from e


class FsspecLocation:
    read_errors: tuple[type[BaseException], ...] = (OSError,)
    service = ""
    listable = True

    def __init__(self, uri: str, options: OpenOptions | None = None) -> None:
        """`options` does not apply: fsspec filesystems keep their own retry policies."""
        self.fs, root = filesystem_for(uri)
        self.root = root.rstrip("/")
        self.uri = uri.rstrip("/")

    def _path(self, relative: str) -> str:
        relative = relative.strip("/")
        return f"{self.root}/{relative}" if relative else self.root

    def child_uri(self, name: str) -> str:
        return f"{self.uri}/{name.strip('/')}"

    def _ls(self) -> list[dict]:
        try:
            return self.fs.ls(self._path(""), detail=True)
        except FileNotFoundError:
            return []

    def list_folders(self) -> list[str]:
        return sorted(
            e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self._ls() if e["type"] == "directory"
        )

    def list_files(self, folder: str) -> dict[str, int]:
        """Every file under `folder`, recursively, by path relative to it."""
        base = self._path(folder)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        prefix = base.rstrip("/") + "/"
        return {
            name[len(prefix) :]: int(info.get("size") or 0)
            for name, info in found.items()
            if name.startswith(prefix) and info.get("type") != "directory"
        }

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self._path(relative))

    def size(self, relative: str) -> int:
        return int(self.fs.size(self._path(relative)))

    def read_bytes(self, relative: str) -> bytes:
        return self.fs.cat_file(self._path(relative))

    def open_read(self, relative: str, *, start: int = 0) -> BinaryIO:
        stream = self.fs.open(self._path(relative), "rb", block_size=READ_BUFFER_BYTES)
        if start:
            stream.seek(start)
        return stream

    def readinto(self, relative: str, offset: int, buffer: memoryview) -> int:
        data = self.fs.cat_file(self._path(relative), start=offset, end=offset + len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def write_bytes(self, relative: str, data: bytes) -> None:
        self._parent(relative)
        self.fs.pipe_file(self._path(relative), data)

    def open_sink(self, relative: str, *, overwrite: bool) -> FsspecSink:
        self._parent(relative)
        return FsspecSink(self, relative, overwrite=overwrite)

    def create_exclusive(self, relative: str, data: bytes) -> bool:
        self._parent(relative)
        try:
            stream = self.fs.open(self._path(relative), "xb")
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError) as e:
            stream, cause = None, f": {e}"
        else:
            cause = ""  # older fsspec filesystems return nothing for a mode they lack
        if stream is None:
            raise StorageError(f"{self.uri}: this filesystem cannot create an object only if it is absent (open "
                               f"mode 'xb'{cause}), which registry names and leases need; upgrade fsspec and "
                               "the filesystem's package")  # fmt: skip
        with stream:
            stream.write(data)
        return True

    def put_file(self, relative: str, path: Path) -> None:
        self._parent(relative)
        self.fs.put_file(str(path), self._path(relative))

    def copy(self, source: str, relative: str) -> None:
        self._parent(relative)
        self.fs.copy(self._path(source), self._path(relative))

    def move(self, source: str, relative: str) -> None:
        self.fs.mv(self._path(source), self._path(relative))

    def _parent(self, relative: str) -> None:
        parent = self._path(relative).rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)  # a no-op on object stores

    def delete(self, relative: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(relative))

    def delete_folder(self, folder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(folder), recursive=True)

    def dcp_writer(
        self, folder: str, *, threads: int | None = None, world_size: int | None = None
    ) -> tuple[FileSystemWriter, HashingFileSystem]:
        from bigclip.storage.dcp_files import fsspec_dcp_writer  # torch: only for checkpoints

        return fsspec_dcp_writer(self.child_uri(folder), threads=threads)

    def dcp_reader(self, folder: str) -> FileSystemReader:
        from bigclip.storage.dcp_files import SafeFsspecReader

        return SafeFsspecReader(self.child_uri(folder))


class FsspecSink(HashedSink):
    """Bytes go to a hidden temporary object beside the target, moved onto it only on commit.
    Without `overwrite`, an existing target is refused at open and again just before the move
    (fsspec offers no atomic exclusive move; registries use `create_exclusive` for names)."""

    def __init__(self, location: FsspecLocation, relative: str, *, overwrite: bool) -> None:
        super().__init__(
            location.child_uri(relative), overwrite=overwrite, exists=lambda: location.exists(relative)
        )
        self.location, self.relative = location, relative
        folder, _, name = relative.rpartition("/")
        hidden = f".{name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        self.tmp = f"{folder}/{hidden}" if folder else hidden
        self._stream = location.fs.open(location._path(self.tmp), "wb")

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self._stream.write(data)

    def commit(self) -> ObjectRecord:
        self._stream.close()
        if not self.overwrite and self.location.exists(self.relative):
            self.abort()
            raise self._appeared()
        self.location.move(self.tmp, self.relative)
        return self._hash.record()

    def abort(self) -> None:
        # An object store's upload is abandoned by `discard` (closing would complete it).
        with contextlib.suppress(Exception):
            getattr(self._stream, "discard", self._stream.close)()
            self._stream.close()
        self.location.delete(self.tmp)
