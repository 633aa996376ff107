"""DCP readers and writers over files: a local folder, or any fsspec filesystem.

Every writer's file system is wrapped in `HashingFileSystem` (hashing.py), so the commit step
knows each object's size and SHA-256 without reading it back; every reader reads `.metadata`
with the restricted unpickler (safe_metadata.py). S3 has its own pair, on s3torchconnector's
client (s3_dcp.py). Imported only when a checkpoint is written or read: it loads torch.
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from bigclip.storage.hashing import HashingFileSystem
from bigclip.storage.safe_metadata import SafeMetadataMixin


class SafeFileSystemReader(SafeMetadataMixin, FileSystemReader):
    """DCP's local reader, reading `.metadata` with a restricted unpickler."""


class SafeFsspecReader(SafeMetadataMixin, FsspecReader):
    """torch's fsspec reader, reading `.metadata` with the restricted unpickler."""


# Files per rank when the caller does not say: a local disk or an fsspec store writes them in
# parallel threads; each rank's files lie flat in the checkpoint folder (`__R_N.distcp`).
DEFAULT_THREADS = 4


def local_dcp_writer(
    folder: str | os.PathLike, *, threads: int | None
) -> tuple[FileSystemWriter, HashingFileSystem]:
    writer = FileSystemWriter(folder, sync_files=True, thread_count=threads or DEFAULT_THREADS)
    hashing = HashingFileSystem(FileSystem(), root=writer.path)
    writer.fs = hashing
    return writer, hashing


def fsspec_dcp_writer(uri: str, *, threads: int | None) -> tuple[FileSystemWriter, HashingFileSystem]:
    """Files are written whole by fsspec (an object store's PUT on close); no fsync applies."""
    writer = FsspecWriter(uri, sync_files=False, thread_count=threads or DEFAULT_THREADS)
    hashing = HashingFileSystem(writer.fs, root=writer.path)
    writer.fs = hashing
    return writer, hashing
