"""`LocalShards`: a tensor that torch.distributed.checkpoint saves and loads from this rank's boxes alone.

A sharded parameter's checkpoint entry needs only the boxes (offsets, sizes) of the full tensor
that this rank holds: DCP records each rank's write items and never a tensor's sharding across
ranks. torch's `ShardedTensor` also carries every other rank's boxes and checks them against
each other whenever one is built, so each rank does O(world) work per parameter on every save
and load (minutes of CPU per save for ViT-bigG-14 at 1024 ranks). `LocalShards` lists only this
rank's boxes, so building one costs O(its own boxes), and the checkpoint is the same.

DCP's planners take it through the duck-typed protocol DTensor implements
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`; torch 2.11 and 2.13
look for these names before anything else). It is a tensor subclass without storage (the full
parameter's shape, dtype and device) because DCP looks state entries up as `torch.Tensor`s. Its
shards are ordinary tensors (views of the caller's memory, so a load writes into them in place).
It supports only what checkpointing does with it: DCP's async stager (`new_empty`, then a deep
copy of the attributes: the shards go to CPU), `detach`, `to`/`cpu`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

aten = torch.ops.aten


class LocalShard(NamedTuple):
    """One box of the full tensor: `tensor` holds its values, `offsets` where it starts."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]


class LocalShards(torch.Tensor):
    """The full tensor's shape, dtype and device; values only in this rank's boxes (`local_shards()`)."""

    _shards: list[torch.Tensor]
    _offsets: list[tuple[int, ...]]
    _pinned: bool  # recorded in the checkpoint's tensor properties, as ShardedTensor records it

    # Plain attribute access (size, device, data_ptr) without a trip through __torch_function__.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        shards: Sequence[torch.Tensor],
        offsets: Sequence[Sequence[int]],
        *,
        size: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        pinned: bool = False,
    ) -> LocalShards:
        size = torch.Size(size)
        offsets = [tuple(int(o) for o in box) for box in offsets]
        _check_boxes(shards, offsets, size, dtype)
        r = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device=device, requires_grad=False)
        r._shards, r._offsets, r._pinned = list(shards), offsets, pinned
        return r

    def local_shards(self) -> list[LocalShard]:
        return [LocalShard(t, o) for t, o in zip(self._shards, self._offsets)]

    # -- DCP's protocol ---------------------------------------------------------------------

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        properties = TensorProperties(
            dtype=self.dtype,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=self._pinned,
        )
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.size()),
            )
            for chunk in self.__create_chunk_list__()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size())
            for t, o in zip(self._shards, self._offsets)
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        hint = index.index  # DCP's guess at the shard's position in the chunk list
        if hint is not None and hint < len(self._offsets) and torch.Size(self._offsets[hint]) == index.offset:
            return self._shards[hint]
        for tensor, offsets in zip(self._shards, self._offsets):
            if torch.Size(offsets) == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: this rank holds no box at offset {index.offset}")

    # -- the few tensor operations checkpointing uses ---------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self = args[0]
        if func is aten.new_empty.default:  # DCP's stager; it then deep-copies the attributes
            dtype, device = kwargs.get("dtype") or self.dtype, kwargs.get("device") or self.device
            return LocalShards([], [], size=args[1], dtype=dtype, device=device, pinned=self._pinned)
        if func is aten.detach.default:
            return self._map(lambda t: t.detach())
        if func is aten._to_copy.default:
            return self._map(lambda t: aten._to_copy.default(t, **kwargs))
        raise NotImplementedError(
            f"{func} on LocalShards: it holds only this rank's boxes of a {tuple(self.shape)} tensor "
            "and serves checkpointing (torch.distributed.checkpoint) alone"
        )

    def _map(self, fn: Any) -> LocalShards:
        shards = [fn(t) for t in self._shards]
        dtype = shards[0].dtype if shards else self.dtype
        device = shards[0].device if shards else self.device
        return LocalShards(
            shards, self._offsets, size=self.shape, dtype=dtype, device=device, pinned=self._pinned
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        boxes = ", ".join(f"{o}+{tuple(t.shape)}" for t, o in zip(self._shards, self._offsets))
        return f"LocalShards(size={tuple(self.shape)}, dtype={self.dtype}, boxes=[{boxes}])"


def _check_boxes(
    shards: Sequence[torch.Tensor], offsets: list[tuple[int, ...]], size: torch.Size, dtype: torch.dtype
) -> None:
    """Each box lies inside the tensor, in its dtype (this rank's boxes only: O(boxes))."""
    if len(shards) != len(offsets):
        raise ValueError(f"{len(shards)} shards but {len(offsets)} offsets")
    for tensor, box in zip(shards, offsets):
        if tensor.dtype != dtype or tensor.dim() != len(size) or len(box) != len(size):
            raise ValueError(
                f"shard {tuple(tensor.shape)} {tensor.dtype} at {box} does not fit {tuple(size)} {dtype}"
            )
        if any(o < 0 or o + n > s for o, n, s in zip(box, tensor.shape, size)):
            raise ValueError(f"shard {tuple(tensor.shape)} at {box} lies outside {tuple(size)}")
