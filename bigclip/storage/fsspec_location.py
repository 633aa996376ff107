"""Any fsspec filesystem as a `Location`: gs://, az://, abfs://, hf://, memory://, ...

For what bigclip only reads or copies to (registry sources, remote-sync targets, resuming from
a remote copy), not for checkpoints written during training: those go to a local folder or S3
through DCP's writers, which is where atomic commits and per-rank streaming are tested. The
filesystem package a scheme needs (gcsfs, adlfs, huggingface_hub...) is imported by fsspec on
first use; when it is missing the error names it, in seconds, before anything is copied.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, BinaryIO

from bigclip.errors import StorageError
from bigclip.storage.safe_metadata import SafeMetadataMixin


def filesystem_for(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, root path) for `uri`; StorageError naming the package to install."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri)
    except ImportError as e:
        scheme = uri.split("://", 1)[0]
        raise StorageError(
            f"{uri}: the {scheme}:// filesystem is not installed ({e}); install that package "
            f"(gs:// gcsfs, az:// and abfs:// adlfs, hf:// huggingface_hub) and retry"
        ) from e
    except ValueError as e:
        raise StorageError(f"{uri}: no filesystem handles this scheme ({e})") from e


class FsspecLocation:
    read_errors: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, uri: str) -> None:
        self.fs, root = filesystem_for(uri)
        self.root = root.rstrip("/")
        self.uri = uri.rstrip("/")

    def _path(self, relative: str) -> str:
        relative = relative.strip("/")
        return f"{self.root}/{relative}" if relative else self.root

    def child_uri(self, name: str) -> str:
        return f"{self.uri}/{name.strip('/')}"

    def _ls(self, relative: str) -> list[dict]:
        try:
            return self.fs.ls(self._path(relative), detail=True)
        except FileNotFoundError:
            return []

    def list_folders(self) -> list[str]:
        return sorted(
            e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self._ls("") if e["type"] == "directory"
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

    def read_bytes(self, relative: str) -> bytes:
        return self.fs.cat_file(self._path(relative))

    def open_read(self, relative: str) -> BinaryIO:
        return self.fs.open(self._path(relative), "rb")

    def write_bytes(self, relative: str, data: bytes) -> None:
        self._parent(relative)
        self.fs.pipe_file(self._path(relative), data)

    def put_file(self, relative: str, path: Path) -> None:
        self._parent(relative)
        self.fs.put_file(str(path), self._path(relative))

    def copy(self, source: str, relative: str) -> None:
        self._parent(relative)
        self.fs.copy(self._path(source), self._path(relative))

    def _parent(self, relative: str) -> None:
        parent = self._path(relative).rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)  # a no-op on object stores

    def delete(self, relative: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(relative))

    def delete_folder(self, folder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(folder), recursive=True)

    def dcp_writer(self, folder: str, *, threads: int) -> Any:
        raise StorageError(
            f"{self.uri}: checkpoints are written to a local folder or s3://; back them up here with "
            "--remote-sync instead"
        )

    def dcp_reader(self, folder: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class SafeFsspecReader(SafeMetadataMixin, FsspecReader):
            """torch's fsspec reader, reading `.metadata` with the restricted unpickler."""

        return SafeFsspecReader(self.child_uri(folder))
