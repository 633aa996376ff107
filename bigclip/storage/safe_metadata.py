"""DCP's `.metadata` read without trusting it: an unpickler that admits only DCP's classes.

DCP's stock readers unpickle `.metadata` with `pickle.load`, which would run code planted in a
checkpoint from a shared bucket. Here it goes through an unpickler that admits only DCP's
metadata classes and torch dtypes/sizes; every reader bigclip builds (local, S3, registry,
consolidation) reads metadata this way.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from bigclip.errors import StorageError

_ALLOWED_GLOBALS: dict[str, set[str] | None] = {
    "torch.distributed.checkpoint.metadata": None,  # any name: DCP's metadata dataclasses
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # plus any torch.dtype, checked below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get(module, set())
        if allowed is None or name in allowed:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise StorageError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never contains; "
            "refusing to load it (the checkpoint may have been tampered with)"
        )


def load_metadata(data: bytes) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except StorageError:
        raise
    except Exception as e:  # garbage unpickles into any error: truncated, wrong opcodes...
        raise StorageError(
            f"checkpoint .metadata is not readable DCP metadata ({type(e).__name__}: {e}); "
            "the checkpoint is damaged: load another one"
        ) from e
    if not isinstance(metadata, Metadata):
        raise StorageError("checkpoint .metadata does not hold DCP metadata")
    return metadata


class SafeMetadataMixin:
    """For DCP FileSystemReader subclasses: read `.metadata` with the restricted unpickler.

    DCP's loader catches what `read_metadata` raises, tries a rank-local `__R.metadata` instead,
    then fails with "metadata is None" (torch 2.11 drops the cause; 2.13 appends its text). So
    the failure is kept in `metadata_failure` for the caller to raise (`metadata_failure_of`),
    and once `.metadata` is refused, every later read is refused too: a planted rank-local file
    must not stand in for a tampered global one.
    """

    metadata_failure: BaseException | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if isinstance(self.metadata_failure, StorageError):
            raise self.metadata_failure
        try:
            metadata = self._read_safely(self._get_metadata_path(kwargs.get("rank")))
        except Exception as e:
            self.metadata_failure = self.metadata_failure or e  # the global file's, not the fallback's
            raise
        self.metadata_failure = None
        return metadata

    def _read_safely(self, path: Any) -> Metadata:
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def metadata_failure_of(reader: object) -> BaseException | None:
    """Why `reader` could not read its checkpoint's metadata (the unpickler's refusal, or the
    I/O error), if it could not; None once a read succeeded."""
    return reader.metadata_failure if isinstance(reader, SafeMetadataMixin) else None
