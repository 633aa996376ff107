"""The checkpoint's own process group: every collective a save or load needs, and nothing else.

Async saves run DCP's planning and the commit from a background thread while training
issues its own collectives. Sharing one group would interleave the two streams of
collectives (a hang or silent corruption), and on GPU the training group is NCCL, which
CPU-side checkpoint metadata should not touch. So the store creates a separate gloo group
(a collective call: every rank constructs its store at the same point) and uses it for
DCP's plan exchange, the manifest commit and "rank 0 decides, everyone learns" steps.
Without torch.distributed it degrades to a world of one.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from bigclip import errors
from bigclip.checkpoint.integrity import CheckpointDamaged
from bigclip.errors import BigclipError, StorageError


class CheckpointGroup:
    def __init__(self, *, timeout_s: float) -> None:
        self.group: dist.ProcessGroup | None = None
        if dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` on rank 0 (an empty list elsewhere)."""
        if self.group is None:
            return [value]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, out, group=self.group, group_dst=0)
        return out or []

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 only; every rank returns its result or raises its error.

        A failure on rank 0 alone must still reach the others, or they would wait in the
        next collective until the group's timeout. Damage stays `CheckpointDamaged` (a load
        may skip a damaged checkpoint); any other failure is raised as its class in
        bigclip.errors, else as a StorageError.
        """
        result: Any = None
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except BigclipError as e:  # the user's error, raised as itself on every rank
                result = (type(e).__name__, str(e))
            except Exception as e:
                result = ("StorageError", f"{type(e).__name__}: {e}")
        kind, value = self.broadcast(result)
        if kind == CheckpointDamaged.__name__:
            raise CheckpointDamaged(value)
        if kind != "ok":
            raise getattr(errors, kind, StorageError)(value)
        return value
