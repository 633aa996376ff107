"""A local folder as a `Location` (locations.py): atomic writes by fsync and rename.

Small objects are written to a hidden temporary name, fsynced and renamed into place (the
folder fsynced too), so a reader sees the old object, no object, or all of the new one; an
object that must not replace another is hard-linked into place instead (link(2) fails if the
name exists): the primitive behind immutable names and leases. Ranged reads are `pread`s.
Needs no library beyond Python's (torch only when a DCP reader or writer is built).

A write that finds the disk full (ENOSPC, or EDQUOT: the quota) removes its temporary file and
raises one StorageError naming the target and saying nothing was committed (full_disk.py). A writer
killed mid-write cannot remove its own: `remove_stale_temporaries` does, at the next start of the
same command on the same output (a temporary file is stale when its writer's pid is gone from this
host and it has not changed for STALE_AFTER_S, so a writer on another host sharing the folder, which
keeps writing, is left alone).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from bigclip.storage.full_disk import full_error
from bigclip.storage.records import ObjectRecord
from bigclip.storage.sinks import HashedSink

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from bigclip.storage.hashing import HashingFileSystem

READ_BUFFER_BYTES = 1 << 20  # streamed reads (tar shards) go through a buffer of this size
STALE_AFTER_S = 60.0
# The hidden names this module writes through: .NAME.tmp-PID[-X] and .NAME.partial-PID-X.
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?:tmp|partial)-(?P<pid>\d+)(?:-[0-9a-f]+)?")


def _discard(path: Path) -> None:
    """Remove a temporary file whatever happened to its writer (a full disk included)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _written_whole(tmp: Path, target: Path) -> Iterator[None]:
    """A write to `tmp` (for `target`) that fails removes it; a full disk is said so, in one line."""
    try:
        yield
    except OSError as e:
        _discard(tmp)
        full = full_error(e, target)
        if full is not None:
            raise full from e
        raise


class LocalLocation:
    read_errors: tuple[type[BaseException], ...] = (OSError,)
    service = ""
    listable = True

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
        """Every file under `folder`, recursively, by its '/'-separated path relative to it (as an
        object store lists a prefix: a checkpoint copied from S3 keeps its ranks' sub-folders)."""
        path = self.root / folder
        if not path.is_dir():
            return {}
        files = {}
        for parent, _, names in os.walk(path):
            under = Path(parent).relative_to(path).as_posix()
            for name in names:
                try:
                    size = os.stat(Path(parent, name)).st_size
                    files[name if under == "." else f"{under}/{name}"] = size
                except FileNotFoundError:
                    continue  # deleted while listed (a lease released, a temporary file renamed)
        return files

    def exists(self, relative: str) -> bool:
        return (self.root / relative).exists()

    def size(self, relative: str) -> int:
        return (self.root / relative).stat().st_size

    def read_bytes(self, relative: str) -> bytes:
        return (self.root / relative).read_bytes()

    def open_read(self, relative: str, *, start: int = 0) -> BinaryIO:
        stream = open(self.root / relative, "rb", buffering=READ_BUFFER_BYTES)  # noqa: SIM115 (the caller closes it)
        if start:
            stream.seek(start)
        return stream

    def readinto(self, relative: str, offset: int, buffer: memoryview) -> int:
        fd = os.open(self.root / relative, os.O_RDONLY)
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

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write, fsync, then rename into place (and fsync the folder): all or nothing."""
        target = self.root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        with _written_whole(tmp, target), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)

    def open_sink(self, relative: str, *, overwrite: bool) -> LocalSink:
        return LocalSink(self.root / relative, overwrite=overwrite)

    def create_exclusive(self, relative: str, data: bytes) -> bool:
        target = self.root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        with _written_whole(tmp, target):
            tmp.write_bytes(data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        fsync_dir(target.parent)
        return True

    def delete(self, relative: str) -> None:
        (self.root / relative).unlink(missing_ok=True)

    def delete_folder(self, folder: str) -> None:
        shutil.rmtree(self.root / folder, ignore_errors=True)

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
            with _written_whole(tmp, target):
                shutil.copyfile(source, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            _discard(tmp)
        fsync_dir(target.parent)

    def remove_stale_temporaries(
        self, folder: str = "", *, names: Collection[str] | None = None
    ) -> list[str]:
        """Delete the temporary files killed writers left in `folder` (of `names` only, if given);
        returns the names removed."""
        path, removed = self.root / folder, []
        entries = path.iterdir() if path.is_dir() else ()
        for entry in entries:
            found = _TEMPORARY.fullmatch(entry.name)
            if found and (names is None or found["name"] in names) and _stale(entry, int(found["pid"])):
                _discard(entry)
                removed.append(f"{folder}/{entry.name}" if folder else entry.name)
        return removed

    def dcp_writer(
        self, folder: str, *, threads: int | None = None, world_size: int | None = None
    ) -> tuple[FileSystemWriter, HashingFileSystem]:
        """`threads`: files per rank (None: 4), flat in the folder; `world_size` changes nothing here."""
        from bigclip.storage.dcp_files import local_dcp_writer  # torch: only for checkpoints

        return local_dcp_writer(self.root / folder, threads=threads)

    def dcp_reader(self, folder: str) -> FileSystemReader:
        from bigclip.storage.dcp_files import SafeFileSystemReader

        return SafeFileSystemReader(self.root / folder)


class LocalSink(HashedSink):
    """Bytes go to a hidden temporary file beside the target, which is fsynced and renamed (or
    hard-linked, to refuse an existing target atomically) only on commit."""

    def __init__(self, target: Path, *, overwrite: bool) -> None:
        super().__init__(str(target), overwrite=overwrite, exists=target.exists)
        self.target = target
        target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = target.with_name(f".{target.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
        self._file = open(self.tmp, "wb")  # noqa: SIM115 (closed by commit or abort)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        try:
            self._file.write(data)
        except OSError as e:
            self._fail(e)
            raise

    def commit(self) -> ObjectRecord:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        except OSError as e:
            self._fail(e)
            raise
        try:
            if self.overwrite:
                os.replace(self.tmp, self.target)
            else:
                os.link(self.tmp, self.target)  # fails if the target appeared meanwhile
                self.tmp.unlink()
        except FileExistsError as e:
            self.abort()
            raise self._appeared() from e
        fsync_dir(self.target.parent)
        return self._hash.record()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()  # flushes what is buffered: on a full disk that fails too
        _discard(self.tmp)

    def _fail(self, error: OSError) -> None:
        """A failed write or flush: nothing is kept; a full disk is said so, in one line."""
        self.abort()
        full = full_error(error, self.target, committed="nothing was committed under that name")
        if full is not None:
            raise full from error


def _stale(path: Path, pid: int) -> bool:
    try:
        quiet_s = time.time() - path.stat().st_mtime
    except OSError:
        return False  # gone meanwhile: committed or removed by its writer
    return quiet_s > STALE_AFTER_S and not pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def fsync_dir(path: Path) -> None:
    """Make a rename or link in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
