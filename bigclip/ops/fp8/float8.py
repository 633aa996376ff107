"""fp8 linears through torchao's float8 training (`torchao.float8`), the recipe torchtitan uses.

Every linear the model contract lists (a CLIP's MLP linears `mlp.c_fc`, `mlp.c_proj` and attention
projections `attn.out_proj` and the fused QKV `attn.in_proj`, in every residual block) computes their three matmuls (output, input
gradient, weight gradient) in float8 with dynamic scales, from the 16-bit weights and activations
the engine hands it; masters, optimizer state, norms, attention itself and the loss are
untouched. Two recipes (torchao's names):
  - tensorwise: one scale per tensor, cuBLAS's fp8 GEMM; the fastest.
  - rowwise: one scale per row (power-of-two scales), CUTLASS's rowwise GEMM; closer to bf16.
The swap keeps every parameter's name, shape and identity (`Float8Linear` is an `nn.Linear`;
the QKV stays `in_proj_weight`/`in_proj_bias`), so FSDP2 shards, DCP saves and consolidation
writes plain weights as for any run. Works on meta-device models: call it before sharding.

The GEMM needs sizes in multiples of 16 and, on the device, an fp8-capable GPU (compute
capability 8.9+); elsewhere torchao's emulation runs the same casts with a high-precision matmul,
which is how the CPU tests check the numerics.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from bigclip.config.linear_kinds import LINEAR_KINDS
from bigclip.errors import ConfigError
from bigclip.models.contract import LinearSlot

RECIPES = tuple(k.variant for k in LINEAR_KINDS.values() if k.family == "fp8")  # torchao recipe names
_ALIGNMENT = 16  # torch._scaled_mm needs both sizes in multiples of 16
Model = TypeVar("Model", bound=nn.Module)


def fp8_shape_supported(in_features: int, out_features: int) -> bool:
    return in_features % _ALIGNMENT == 0 and out_features % _ALIGNMENT == 0


FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with fp8 tensor cores


def needs_emulation(device_type: str) -> bool:
    """True on a CPU (torchao emulates the GEMMs); False on an fp8 GPU; a ConfigError on a GPU
    without fp8, where emulation would only be slower than 16-bit linears."""
    if device_type != "cuda":
        return True
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        raise ConfigError(
            f"fp8 linear kinds need a GPU of compute capability 8.9 or more (Ada, Hopper); "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}: use --linear-kind "
            "switchback-global or none"
        )
    return False


def float8_config(recipe: str, *, emulate: bool = False) -> Any:
    """torchao's `Float8LinearConfig` for one of RECIPES (`emulate`: no fp8 GEMM, for CPUs)."""
    if recipe not in RECIPES:
        raise ConfigError(f"fp8 recipe {recipe!r} is unknown; use one of {', '.join(RECIPES)}")
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=True) if emulate else config


class Float8Projection:
    """The fused QKV projection (`attn.in_proj(x, weight, bias)`) in float8, as `Float8Linear`
    computes it: the parameters stay the attention's own (`in_proj_weight`, `in_proj_bias`)."""

    def __init__(self, config: Any) -> None:
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.config = config
        gemm = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
        self.mm_config = LinearMMConfig(
            *(ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemm)
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        out = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return out if bias is None else out + bias.to(out.dtype)


def _swap(slot: LinearSlot, config: Any, skipped: list[str]) -> None:
    from torchao.float8.float8_linear import Float8Linear

    current = getattr(slot.parent, slot.attr)
    if isinstance(current, (Float8Linear, Float8Projection)):
        return
    if not fp8_shape_supported(slot.in_features, slot.out_features):
        skipped.append(f"{slot.name} ({slot.in_features}->{slot.out_features})")
    elif slot.kind == "projection":
        setattr(slot.parent, slot.attr, Float8Projection(config))
    else:
        setattr(slot.parent, slot.attr, Float8Linear.from_float(current, config=config))


def apply_fp8(
    model: Model, recipe: str, *, emulate: bool = False, slots: Sequence[LinearSlot] | None = None
) -> Model:
    """Swap every linear the model contract lists (`swappable_linears()`: a CLIP's MLP and
    attention linears in every block), or exactly `slots` of them (the run's choice by the measured
    shape table, models/from_config.py), for torchao's float8 ones. In place; returns the model.
    Linears whose sizes are not multiples of 16 stay 16-bit (one warning)."""
    config = float8_config(recipe, emulate=emulate)
    skipped: list[str] = []
    for slot in model.swappable_linears() if slots is None else slots:
        _swap(slot, config, skipped)
    if skipped:
        warnings.warn(
            f"fp8: {len(skipped)} linear(s) stay 16-bit (sizes not multiples of {_ALIGNMENT}): "
            + ", ".join(skipped[:4])
            + (" ..." if len(skipped) > 4 else ""),
            stacklevel=2,
        )
    return model
