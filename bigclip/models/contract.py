"""The model contract: everything the engines and the linear-kind swaps may know of a model.

CLIP implements it (models/clip.py); any model family that does trains on FSDP2 and DeepSpeed
and takes the int8/fp8 linear kinds (tests/test_model_contract.py trains one that is not CLIP;
docs/extending.md says how to add one). tests/test_layout.py keeps engines/ and ops/ from
importing anything else of models/.

  blocks()              residual blocks: the units engines shard (FSDP2's fully_shard, ZeRO-3's
                        leaf modules), compile and checkpoint.
  param_initializers()  {parameter name: fn(full fp32 tensor, generator)}: each parameter's initial
                        value, drawn whole from a generator seeded by (seed, name), so a run starts
                        from the same weights at any world size (`initial_values`).
  input_dtype           the dtype the model's first layer takes; the loader normalises images into it.
  hidden_width          the widest residual stream (DeepSpeed sizes its "auto" buckets from it).
  replicated_scalars()  {name: (low, high)}: 0-dim parameters engines keep whole on every rank, and
                        the range each is clamped into after every optimizer step (None: open).
  swappable_linears()   the linears a low-precision kind may swap, block by block (`LinearSlot`).
A model's forward takes (images, texts) and returns the dict the contrastive losses read
(`image_features`, `text_features`, `logit_scale`, optional `logit_bias`).

The planner and consolidation see a model through the contract's static half, which needs no
instance and no torch: its family's `ModelShape` (shape.py, looked up by name in families.py).
`param_shapes(model)` lists a built model as a shape lists it, so a family's test can hold the two
together.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from bigclip.models.activation_checkpointing import skip_recompute_check
from bigclip.models.shape import ParamShape

InitFn = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
ScalarRange = tuple[float | None, float | None]

__all__ = [
    "InitFn",
    "LinearSlot",
    "ScalarRange",
    "TrainableModel",
    "initial_values",
    "param_generator",
    "param_shapes",
    "skip_recompute_check",  # a block's checkpointing switch ZeRO-3 turns (see there)
]


@dataclass(frozen=True)
class LinearSlot:
    """One linear of a block. `kind` "linear": `getattr(parent, attr)` is an nn.Linear, swapped
    for another module. "projection": `getattr(parent, attr)` is a function (x, weight, bias) over
    the parent's parameters `weight_name`/`bias_name` (a fused QKV), swapped for another function."""

    name: str  # the linear's module path, for messages
    parent: nn.Module
    attr: str
    role: str  # "mlp" or "attention": kinds choose by role (--int8-attention adds attention)
    kind: str = "linear"
    in_features: int = 0
    out_features: int = 0


@runtime_checkable
class TrainableModel(Protocol):
    def blocks(self) -> list[nn.Module]: ...

    def param_initializers(self) -> dict[str, InitFn]: ...

    @property
    def input_dtype(self) -> torch.dtype: ...

    @property
    def hidden_width(self) -> int: ...

    def replicated_scalars(self) -> dict[str, ScalarRange]: ...

    def swappable_linears(self) -> list[LinearSlot]: ...


def param_generator(name: str, seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream depends only on (seed, parameter name): same values at any world size."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def initial_values(
    model: TrainableModel, shapes: dict[str, torch.Size], *, seed: int, device: torch.device | str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's whole initial value (fp32), one at a time: the one initialisation loop,
    which an unsharded model copies in and each engine cuts to its shards."""
    rules = model.param_initializers()
    for name, shape in shapes.items():
        full = torch.empty(shape, dtype=torch.float32, device=device)
        rules[name](full, param_generator(name, seed, device))
        yield name, full


def param_shapes(model: nn.Module) -> tuple[ParamShape, ...]:
    """A built model's parameters as its family's `ModelShape.params` must list them: name, shape
    and residual block (the index in `blocks()`, -1 outside them), in `named_parameters()` order."""
    block_of = {id(p): i for i, block in enumerate(model.blocks()) for p in block.parameters()}
    return tuple(ParamShape(n, tuple(p.shape), block_of.get(id(p), -1)) for n, p in model.named_parameters())
