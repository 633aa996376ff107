"""torchao float8's side of the linear-kind registration (config/linear_kinds.py): its machine check
(an fp8 GPU, or a CPU that emulates it) and its swap, with the line a run prints about it."""

from __future__ import annotations

from collections.abc import Sequence

from bigclip.config.linear_kinds import LinearKind
from bigclip.models.contract import LinearSlot, TrainableModel
from bigclip.ops.fp8.float8 import apply_fp8, needs_emulation


def check_machine(kind: LinearKind, device_type: str) -> None:
    needs_emulation(device_type)  # one line on a GPU without fp8


def apply(model: TrainableModel, kind: LinearKind, *, slots: Sequence[LinearSlot], device_type: str) -> str:
    emulate = needs_emulation(device_type)
    apply_fp8(model, kind.variant, emulate=emulate, slots=slots)
    path = (
        "emulated on the CPU (torchao's casts, high-precision matmuls)" if emulate else "fp8 GEMMs on the GPU"
    )
    return f"linear kind {kind.name}: torchao float8 ({kind.variant} scales); {path}"
