"""Checksums computed while DCP writes, so committing a checkpoint never re-reads it.

`HashingFileSystem` wraps the file system a DCP writer streams through (local files,
s3torchconnector's `S3FileSystem`, torch's fsspec one): every object opened for writing is hashed (SHA-256) and
counted as the bytes pass, and recorded only once its stream closed cleanly (for S3: once
the upload completed). Objects are named by their path relative to the checkpoint folder (S3
writers put each rank's objects in a sub-folder, `ab12/__3_0.distcp`). A failed write is kept
as a failure until the same name is written whole (the S3 writer writes a throttled object
again). DCP writes `.metadata` as `.metadata.tmp` then renames it, so a rename moves the record. Hashing releases the GIL and runs at ~1.7 GB/s here, far above what one
rank uploads.

A failed object is recorded (`failures`, which the commit step checks) and its error raised; DCP's
extra writer threads die of it, and Python's default hook would print each one's traceback: such
recorded errors are not printed (`_quiet_recorded`), the commit's one line says what failed. A
full disk is one StorageError naming the folder and saying the checkpoint is not committed.
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from collections.abc import Generator
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystemBase

from bigclip.storage.full_disk import full_error
from bigclip.storage.records import Hasher, ObjectRecord

_RECORDED = "_bigclip_recorded"  # set on an error HashingFileSystem recorded as a failure


def _quiet_recorded(args: threading.ExceptHookArgs, *, fallback=threading.excepthook) -> None:  # noqa: ANN001
    """threading.excepthook: a writer thread's recorded failure is reported by the commit, once."""
    if not getattr(args.exc_value, _RECORDED, False):
        fallback(args)


threading.excepthook = _quiet_recorded


class _HashingWriter(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through to `raw`, and keeps the
    CRC-32 of each stretch between two `tell()`s: DCP asks `tell()` before and after each chunk it
    writes, so these are its chunks' CRC-32s, by offset (rank_record.py keeps them for readers)."""

    def __init__(self, raw: io.IOBase) -> None:
        self._raw = raw
        self._hash = Hasher()
        self.chunk_crcs: dict[int, int] = {}  # offset -> CRC-32 of the bytes up to the next tell()
        self._mark, self._crc = 0, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # noqa: ANN001 (bytes-like, as io.RawIOBase.write)
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        # Raw streams may write fewer bytes; DCP's streams (files, S3Writer) write all of it.
        if written is not None and written != len(view):
            raise OSError(f"short write: {written} of {len(view)} bytes")
        self._hash.update(view)
        self._crc = zlib.crc32(view, self._crc)
        return len(view)

    def tell(self) -> int:
        position = self._hash.size
        if position != self._mark:
            self.chunk_crcs[self._mark] = self._crc
            self._mark, self._crc = position, 0
        return position

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()  # lets DCP fsync local files

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._raw.close()  # for S3 this completes the upload
        finally:
            super().close()

    def record(self) -> ObjectRecord:
        return self._hash.record()


class HashingFileSystem(FileSystemBase):
    """Delegates to `inner`, recording size and checksum of each object written through it."""

    def __init__(self, inner: FileSystemBase, *, root: str | os.PathLike) -> None:
        """`root`: the checkpoint folder the writer writes under (its `path`); names are relative to it."""
        self.inner = inner
        self.root = os.fspath(root)
        self._records: dict[str, ObjectRecord] = {}
        self._chunk_crcs: dict[str, dict[int, int]] = {}
        self._failures: dict[str, str] = {}
        self._lock = threading.Lock()  # DCP writes with several threads per rank

    def records(self) -> dict[str, ObjectRecord]:
        """Objects written so far, keyed by their path relative to the checkpoint folder."""
        with self._lock:
            return dict(self._records)

    def chunk_crcs(self, name: str) -> dict[int, int]:
        """The CRC-32s of the chunks of object `name` (relative), by offset ({} if not written here)."""
        with self._lock:
            return dict(self._chunk_crcs.get(name, {}))

    def failures(self) -> dict[str, str]:
        """Objects whose write failed (and was not written whole since). DCP's extra writer
        threads (thread_count > 1) die with their exception printed but not raised, so
        `dcp.save` can return normally without them: the commit step must check this."""
        with self._lock:
            return dict(self._failures)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with self.inner.create_stream(path, mode) as raw:
                writer = _HashingWriter(raw)
                yield writer
                writer.close()
        except Exception as e:
            folder = os.path.dirname(os.fspath(path))
            committed = (f"this checkpoint is not committed ({self._name(path)} could not be written; the previous "
                         "commit, if any, is still the latest)")  # fmt: skip
            error = full_error(e, folder, committed=committed) or e
            with self._lock:
                self._failures[self._name(path)] = f"{type(error).__name__}: {error}"
            setattr(error, _RECORDED, True)
            if error is e:
                raise
            raise error from e
        except BaseException as e:  # KeyboardInterrupt and the like: recorded, and left to go on
            with self._lock:
                self._failures[self._name(path)] = f"{type(e).__name__}: {e}"
            raise
        # Only reached when the inner stream closed without error: the object is complete.
        with self._lock:
            self._records[self._name(path)] = writer.record()
            self._chunk_crcs[self._name(path)] = writer.chunk_crcs
            self._failures.pop(self._name(path), None)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)
        with self._lock:
            if self._name(path) in self._records:
                self._records[self._name(new_path)] = self._records.pop(self._name(path))
                self._chunk_crcs[self._name(new_path)] = self._chunk_crcs.pop(self._name(path), {})

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return self.inner.concat_path(path, suffix)

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        initialised = self.inner.init_path(path)
        self.root = os.fspath(initialised)  # DCP's reset(checkpoint_id) points the writer elsewhere
        return initialised

    def mkdir(self, path: str | os.PathLike) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.inner.rm_file(path)
        with self._lock:
            self._records.pop(self._name(path), None)
            self._chunk_crcs.pop(self._name(path), None)

    def _name(self, path: str | os.PathLike) -> str:
        """`path` relative to the checkpoint folder (its last part if it lies elsewhere)."""
        full, root = os.fspath(path).rstrip("/"), self.root.rstrip("/") + "/"
        return full[len(root) :] if full.startswith(root) else full.rsplit("/", 1)[-1]
