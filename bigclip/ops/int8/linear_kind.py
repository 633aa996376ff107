"""SwitchBack's side of the linear-kind registration (config/linear_kinds.py): its machine check and
its swap of the model contract's linears, with the line a run prints about it."""

from __future__ import annotations

from bigclip.config.linear_kinds import LinearKind
from bigclip.models.contract import TrainableModel
from bigclip.ops.int8.custom_ops import describe_path
from bigclip.ops.int8.switchback import apply_int8


def check_machine(kind: LinearKind, device_type: str) -> None:
    """Every machine runs it: Triton kernels on a GPU, torch's int8 matmuls on a CPU."""


def apply(model: TrainableModel, kind: LinearKind, *, include_attention: bool, device_type: str) -> str:
    apply_int8(model, kind.name, include_attention=include_attention)
    where = "MLP and attention linears" if include_attention else "MLP linears (attention stays 16-bit)"
    return (
        f"linear kind {kind.name}: SwitchBack int8 ({kind.variant} quantisation) in every block's {where}; "
        f"int8 matmuls on {describe_path(device_type)}"
    )
