"""SwitchBack's side of the linear-kind registration (config/linear_kinds.py): its machine check and
its swap of the model contract's linears, with the line a run prints about it."""

from __future__ import annotations

from collections.abc import Sequence

from bigclip.config.linear_kinds import LinearKind
from bigclip.models.contract import LinearSlot, TrainableModel
from bigclip.ops.int8.custom_ops import describe_path
from bigclip.ops.int8.switchback import apply_int8


def check_machine(kind: LinearKind, device_type: str) -> None:
    """Every machine runs it: Triton kernels on a GPU, torch's int8 matmuls on a CPU."""


def apply(model: TrainableModel, kind: LinearKind, *, slots: Sequence[LinearSlot], device_type: str) -> str:
    apply_int8(model, kind.name, slots=slots)
    return (
        f"linear kind {kind.name}: SwitchBack int8 ({kind.variant} quantisation); "
        f"int8 matmuls on {describe_path(device_type)}"
    )
