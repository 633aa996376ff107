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
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise StorageError("checkpoint .metadata does not hold DCP metadata")
    return metadata


class SafeMetadataMixin:
    """For DCP FileSystemReader subclasses: read `.metadata` with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
