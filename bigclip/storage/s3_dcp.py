"""DCP readers and writers for an S3 prefix, on s3torchconnector's CRT client.

`S3Location` (s3_location.py) reads and writes checkpoints this way. The DCP classes
take no endpoint argument, so their `.fs` is replaced by one built on our client (endpoint and
path-style addressing from `S3Settings`). The writer is s3_dcp_writer.py's: each rank under a
prefix of its own, few requests, throttled objects written again. Imported only for S3 checkpoints.
"""

from __future__ import annotations

from typing import Any

from s3torchconnector.dcp import S3FileSystem, S3StorageReader
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from bigclip.storage.hashing import HashingFileSystem
from bigclip.storage.s3 import S3Settings, s3torch_client
from bigclip.storage.s3_dcp_writer import S3CheckpointWriter
from bigclip.storage.safe_metadata import SafeMetadataMixin


class SafeS3StorageReader(SafeMetadataMixin, S3StorageReader):
    """s3torchconnector's DCP reader, reading `.metadata` with a restricted unpickler."""


def _file_system(settings: S3Settings, client: Any, **kwargs: Any) -> S3FileSystem:
    return S3FileSystem(settings.region_name, s3_client=client, **kwargs)


def s3_dcp_reader(uri: str, *, settings: S3Settings, client: Any = None) -> FileSystemReader:
    """A DCP reader of the checkpoint folder `uri` (s3://...); `client`: an s3torchconnector
    client to share (default: a new one from `settings`)."""
    client = client or s3torch_client(settings)
    reader = SafeS3StorageReader(settings.region_name, uri)
    reader.fs = _file_system(settings, client, reader_constructor=reader._reader_constructor)
    return reader


def s3_dcp_writer(
    uri: str, *, settings: S3Settings, client: Any, threads: int | None, world_size: int
) -> tuple[FileSystemWriter, HashingFileSystem]:
    """A DCP writer into `uri` whose file system hashes every byte it writes; `threads`: objects
    per rank (None: by the rank's bytes); `world_size`: how many rank prefixes there are."""
    writer = S3CheckpointWriter(settings.region_name, uri, world_size=world_size, files=threads)
    hashing = HashingFileSystem(_file_system(settings, client), root=writer.path)
    writer.fs = hashing
    return writer, hashing
