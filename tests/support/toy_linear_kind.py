"""A linear kind that is none of bigclip's, registered the way docs/extending.md says: its module
(this one: `check_machine` and `apply`) and one `register_linear_kind` row. Its linears compute
with weights rounded to bfloat16 (a stand-in for a low-precision format), MLP linears only, on CPUs
only. tests/test_linear_kind_registry.py builds, checks and trains a model with it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bigclip.config.linear_kinds import LinearKind, register_linear_kind
from bigclip.errors import ConfigError
from bigclip.models.contract import LinearSlot, TrainableModel

KIND = LinearKind("toy-bf16-weights", "toy", "bf16", "", "never", implementation=__name__)
CHECKED: list[str] = []  # the device types check_machine was asked about, in order


class RoundedLinear(nn.Linear):
    """nn.Linear whose forward reads its weight rounded to bfloat16 (same parameters, same names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(torch.bfloat16).to(x.dtype), self.bias)


def check_machine(kind: LinearKind, device_type: str) -> None:
    CHECKED.append(device_type)
    if device_type != "cpu":
        raise ConfigError(f"--linear-kind {kind.name} runs on CPUs only; this run computes on {device_type}")


def apply(model: TrainableModel, kind: LinearKind, *, slots: Sequence[LinearSlot], device_type: str) -> str:
    swapped = 0
    for slot in slots:  # the run's choice: MLP linears (its `attention` is "never"), by shape
        if slot.kind != "linear":
            continue
        old = getattr(slot.parent, slot.attr)
        new = RoundedLinear(old.in_features, old.out_features, device="meta")
        new.weight, new.bias = old.weight, old.bias  # the same parameters: names, shapes, sharding
        setattr(slot.parent, slot.attr, new)
        swapped += 1
    return f"linear kind {kind.name}: {swapped} MLP linears read bfloat16-rounded weights"


def register() -> LinearKind:
    return register_linear_kind(KIND)
