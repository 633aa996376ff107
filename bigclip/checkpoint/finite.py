"""Finite checks: no NaN or inf is ever committed to a checkpoint or loaded from one.

A tensor's sum is non-finite whenever one of its values is (NaN and inf propagate), and a sum is
a reduction at memory speed with nothing allocated; only when the sum overflows (or is
non-finite) is the exact element-wise test run. The state a save receives is walked as DCP
would name it (`model.visual.proj`, `optim.state.x.exp_avg`); each rank tests its own shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from bigclip.errors import StorageError


class NonFiniteState(StorageError):
    """A save refused because the state holds NaN or inf: the run diverged, unlike a store that
    failed (the checkpointer ends the run on this one whatever the cadence)."""


def is_finite(tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    if tensor.dtype.itemsize == 1:  # float8 kinds: no reductions of their own
        tensor = tensor.to(wide)
    return bool(torch.isfinite(tensor.sum(dtype=wide))) or bool(torch.isfinite(tensor).all())


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each top-level `Stateful` replaced by its state dict, as DCP's save does
    itself (so passing the result to DCP calls no `state_dict()` twice)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def local_tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(DCP key, this rank's tensor) for every tensor in a nested state (DTensors: the local shard)."""
    if isinstance(value, DTensor):
        yield prefix, value.to_local()
    elif hasattr(value, "local_shards"):  # ShardedTensor
        for shard in value.local_shards():
            yield prefix, shard.tensor
    elif isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from local_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from local_tensors(item, f"{prefix}.{index}")


def first_non_finite(state: dict[str, Any]) -> str | None:
    """The key of the first tensor of `state` (this rank's part) holding NaN or inf, or None."""
    return next((key for key, tensor in local_tensors(state) if not is_finite(tensor.detach())), None)
