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

import functools
import io
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from bigclip.checkpoint.finite import is_finite
from bigclip.checkpoint.integrity import (
    CheckpointDamaged,
    MemoryFile,
    check_crcs,
    check_object,
    check_written,
    damaged,
    parse_chunk,
    tensor_of,
)
from bigclip.storage.records import ObjectRecord
from bigclip.storage.safe_metadata import load_metadata

METADATA_NAME = ".metadata"
CRC_THREADS = 2
CRC_IN_FLIGHT = 4  # chunks whose buffers wait for their CRC-32 (memory: that many chunks)


class VerifiedReader(StorageReader):
    """`inner`'s reading, with every chunk and `.metadata` checked (see the module docstring)."""

    def __init__(
        self,
        inner: Any,
        *,
        uri: str,
        objects: dict[str, ObjectRecord],
        crcs: dict[tuple[str, int], int] | None = None,
    ) -> None:
        """`crcs`: (file, offset) -> each chunk's CRC-32 as written (the rank records'); a chunk
        without one is checked against its own zip's CRC-32s."""
        self.inner = inner
        self.uri = uri.rstrip("/")
        self.objects = objects  # the manifest's records: `.metadata`'s SHA-256
        self.crcs = crcs or {}
        self._metadata: Metadata | None = None  # read once: `load` checks it before DCP asks

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
        if self._metadata is None:
            self._metadata = self._read_checked_metadata()
        return self._metadata

    def _read_checked_metadata(self) -> Metadata:
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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:  # in the plan's order (the S3 reader sorted it by offset)
            per_file.setdefault(self.inner.storage_data[item.storage_index].relative_path, []).append(item)
        # CRC-32s run on helper threads (zlib releases the GIL) while the next chunk is read and
        # copied; the load returns only once every one of them passed.
        buffers = _Buffers(keep=CRC_IN_FLIGHT + 1)
        with ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="bigclip-crc") as pool:
            pending: deque[tuple[Future, torch.Tensor]] = deque()
            for relative_path, items in per_file.items():
                path = self.inner.fs.concat_path(self.inner.path, relative_path)
                with self.inner.fs.create_stream(path, "rb") as stream:
                    for item in items:
                        check, buffer = self._read_item(stream, item, planner, relative_path, buffers)
                        pending.append((pool.submit(check), buffer))
                        while len(pending) > CRC_IN_FLIGHT or (pending and pending[0][0].done()):
                            _settle(pending.popleft(), buffers)
            while pending:
                _settle(pending.popleft(), buffers)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_item(
        self, stream: Any, item: ReadItem, planner: LoadPlanner, relative_path: str, buffers: _Buffers
    ) -> tuple[Callable[[], None], torch.Tensor]:
        """Read one chunk into the state; returns its CRC check (for a helper thread) and the buffer
        it checks (reused once the check passed)."""
        info = self.inner.storage_data[item.storage_index]
        where = f"{self.uri}/{relative_path} (byte {info.offset})"
        key = item.dest_index.fqn
        raw = self.inner.transforms.transform_load_stream(
            item, info.transform_descriptors or (), self.inner._slice_file(stream, info)
        )
        if info.transform_descriptors:  # decompressed: its length is not recorded
            buffer = torch.frombuffer(bytearray(raw.read()) or bytearray(1), dtype=torch.uint8)
        else:
            buffer = buffers.take(info.length)
            _fill(
                raw,
                buffer,
                info.length,
                lambda: damaged(where, key, f"is shorter than its {info.length} bytes"),
            )
        data = memoryview(buffer.numpy())[: info.length if not info.transform_descriptors else None]
        records = parse_chunk(data, where=where, key=key)
        written = None if info.transform_descriptors else self.crcs.get((relative_path, info.offset))
        if written is not None:  # the writer's CRC-32 of every byte: also binds the file to this save
            check = functools.partial(check_written, data, written, where=where, key=key)
        else:
            check = functools.partial(check_crcs, data, records, where=where, key=key)
        if item.type == LoadItemType.BYTE_IO:
            check()  # before unpickling anything
            planner.load_bytes(item, MemoryFile(data))
            return _nothing, buffer
        tensor = narrow_tensor_by_index(
            tensor_of(data, records, where=where, key=key), item.storage_offsets, item.lengths
        )
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise damaged(
                where, key, f"holds shape {tuple(tensor.size())}, the plan expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        if not is_finite(target):  # on the device: free on a GPU
            # A flipped byte can decode as NaN: damage, named as such, unless the bytes are as written.
            check()
            raise CheckpointDamaged(
                f"{where}: {key} holds NaN or inf although its bytes are as written (the run diverged "
                "before this save); resume from an older checkpoint (--resume PATH)"
            )
        planner.commit_tensor(item, target)
        return check, buffer


def _nothing() -> None:
    return None


def _settle(entry: tuple[Future, torch.Tensor], buffers: _Buffers) -> None:
    """Wait for one chunk's CRC check (raising its error); then its buffer may be reused."""
    future, buffer = entry
    future.result()
    buffers.give(buffer)


def _fill(stream: io.IOBase, buffer: torch.Tensor, length: int, short: Callable[[], Exception]) -> None:
    """Read `length` bytes of `stream` straight into `buffer`."""
    view, filled = memoryview(buffer.numpy()), 0
    while filled < length:
        n = stream.readinto(view[filled:length])
        if not n:
            raise short()
        filled += n


class _Buffers:
    """Chunk buffers reused from chunk to chunk (uninitialised, never zero-filled). A fresh buffer
    per chunk costs a page fault per 4 KiB, on a CPU box as much time as the read itself."""

    def __init__(self, *, keep: int) -> None:
        self.keep, self.free = keep, []

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if not fits:
            return torch.empty(max(1, nbytes), dtype=torch.uint8)
        return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))  # by index: tensors have no ==

    def give(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)
        if len(self.free) > self.keep:
            self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))
