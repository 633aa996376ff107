"""Single-tensor collectives under whichever name the running torch has.

torch 2.13 named them `all_gather_single` / `reduce_scatter_single` and deprecated the older
`all_gather_into_tensor` / `reduce_scatter_tensor` (a FutureWarning on every call); torch 2.9 to
2.12, the GPU machines' 2.11 among them, have only the older names. Same arguments, same
semantics (output and input concatenated along dim 0), so the loss code calls these two and
never names either version. The name is looked up on every call: a test can take the new one
away to run the old path on a new torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# (name in torch >= 2.13, name in older torch)
ALL_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")


def pick(names: tuple[str, str], namespace: object = dist) -> Callable:
    """The first of `names` that `namespace` has (the new name where it exists)."""
    for name in names:
        fn = getattr(namespace, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"torch.distributed has none of {names}: bigclip needs torch >= 2.9")


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> None:
    """output <- every rank's `input` concatenated along dim 0, in rank order."""
    pick(ALL_GATHER_NAMES)(output, input, group=group)


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> None:
    """output <- this rank's slice (along dim 0) of the sum of every rank's `input`."""
    pick(REDUCE_SCATTER_NAMES)(output, input, group=group)
