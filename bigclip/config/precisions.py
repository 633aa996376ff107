"""The precisions a run can train in, declared once: what each means for the stored parameters,
the blocks' compute, the gradient reduction and loss scaling, and which DeepSpeed section it turns
on. Config validation, both engines (engines/optimizer.py's `Precision`, engines/deepspeed_config.py),
the planner and the tests read this table; the linear kinds are beside it (linear_kinds.py).

  fp32       everything in fp32.
  amp_bf16   fp32 masters, every module computes in bf16, gradients reduced in fp32 (both engines).
  amp        the same in fp16, with dynamic loss scaling (DeepSpeed on CPU: only where oneDNN has fp16).
  pure_bf16  parameters, optimizer state and compute in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionKind:
    name: str
    compute: str  # torch dtype name the residual blocks compute in
    params: str  # dtype of the stored (sharded) parameters and the optimizer's masters
    reduce: str  # dtype gradients are reduced in
    loss_scaling: bool  # fp16 needs dynamic loss scaling
    deepspeed: str  # the ds_config section it enables: "", "fp16" or "bf16"


PRECISION_KINDS: dict[str, PrecisionKind] = {
    p.name: p
    for p in (
        PrecisionKind("amp_bf16", "bfloat16", "float32", "float32", False, "bf16"),
        PrecisionKind("amp", "float16", "float32", "float32", True, "fp16"),
        PrecisionKind("fp32", "float32", "float32", "float32", False, ""),
        PrecisionKind("pure_bf16", "bfloat16", "bfloat16", "bfloat16", False, "bf16"),
    )
}
PRECISIONS = tuple(PRECISION_KINDS)
