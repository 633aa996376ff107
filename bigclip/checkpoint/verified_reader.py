"""DCP loading that checks every byte it reads against what the writer recorded, as it reads.

`VerifiedReader` wraps any of bigclip's DCP storage readers (local, S3, fsspec) and replaces
only `read_data`: each chunk's bytes are read once into a buffer, every record of its
torch.save zip is checked against its CRC-32 (`integrity.check_chunk`), and the tensor is
built on that same buffer, tested for NaN/inf (a sum, finite.py) and copied into the state:
the checks cost a CRC pass and a sum over memory, and no extra read or copy. `.metadata` is
checked against the manifest's SHA-256 before it is parsed. A mismatch raises `CheckpointDamaged` naming the object, the byte, the
tensor and what to do; DCP hands it to every rank, so all ranks learn of it together.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from bigclip.checkpoint.finite import is_finite
from bigclip.checkpoint.integrity import (
    CheckpointDamaged,
    MemoryFile,
    check_chunk,
    check_object,
    damaged,
    tensor_of,
)
from bigclip.storage.hashing import ObjectRecord
from bigclip.storage.safe_metadata import load_metadata

METADATA_NAME = ".metadata"


class VerifiedReader(StorageReader):
    """`inner`'s reading, with every chunk and `.metadata` checked (see the module docstring)."""

    def __init__(self, inner: Any, *, uri: str, objects: dict[str, ObjectRecord]) -> None:
        self.inner = inner
        self.uri = uri.rstrip("/")
        self.objects = objects  # the manifest's records: `.metadata`'s SHA-256

    def __getattr__(self, name: str) -> Any:  # anything else DCP asks of a reader
        return getattr(self.inner, name)

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)

    def validate_checkpoint_id(self, checkpoint_id: Any) -> bool:
        return self.inner.validate_checkpoint_id(checkpoint_id)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self.inner.prepare_global_plan(plans)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The global `.metadata`, checked against the manifest, then parsed safely. A refusal is
        kept on the inner reader, which then refuses DCP's rank-local fallback too."""
        if kwargs.get("rank") is not None or METADATA_NAME not in self.objects:
            return self.inner.read_metadata(*args, **kwargs)
        try:
            with self.inner.fs.create_stream(self.inner._get_metadata_path(), "rb") as stream:
                data = stream.read()
            check_object(data, self.objects[METADATA_NAME], where=f"{self.uri}/{METADATA_NAME}")
            metadata = load_metadata(data)
        except Exception as e:
            self.inner.metadata_failure = getattr(self.inner, "metadata_failure", None) or e
            raise
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        metadata.storage_meta.load_id = self.inner.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:  # in the plan's order (the S3 reader sorted it by offset)
            per_file.setdefault(self.inner.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            path = self.inner.fs.concat_path(self.inner.path, relative_path)
            with self.inner.fs.create_stream(path, "rb") as stream:
                for item in items:
                    self._read_item(stream, item, planner, relative_path)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, stream: Any, item: ReadItem, planner: LoadPlanner, relative_path: str) -> None:
        info = self.inner.storage_data[item.storage_index]
        where = f"{self.uri}/{relative_path} (byte {info.offset})"
        key = item.dest_index.fqn
        raw = self.inner.transforms.transform_load_stream(
            item, info.transform_descriptors or (), self.inner._slice_file(stream, info)
        )
        data = _read_whole(raw, info.length if not info.transform_descriptors else None, lambda: damaged(
            where, key, f"is truncated (fewer than the {info.length} bytes .metadata records)"))  # fmt: skip
        records = check_chunk(data, where=where, key=key)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, MemoryFile(data))
            return
        tensor = narrow_tensor_by_index(
            tensor_of(data, records, where=where, key=key), item.storage_offsets, item.lengths
        )
        if not is_finite(tensor):
            raise CheckpointDamaged(
                f"{where}: {key} holds NaN or inf although its bytes are as written (the run diverged "
                "before this save); resume from an older checkpoint (--resume PATH)"
            )
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise damaged(
                where, key, f"holds shape {tuple(tensor.size())}, the plan expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _read_whole(stream: io.IOBase, length: int | None, short: Callable[[], Exception]) -> memoryview:
    """All of `stream` (`length` bytes when known, read straight into one buffer)."""
    if length is None:
        return memoryview(stream.read())
    buffer = bytearray(length)
    view, filled = memoryview(buffer), 0
    while filled < length:
        n = stream.readinto(view[filled:])
        if not n:
            raise short()
        filled += n
    return view
