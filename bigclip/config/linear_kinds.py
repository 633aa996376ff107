"""The linear kinds a run can put in its residual blocks' linears, declared once.

`--linear-kind` picks one; config validation, the model swap (`models/from_config.py`), the
planner and the tests read this table, and the ops that implement a family (`ops/int8`,
`ops/fp8`) take its `variant`. Which linears a kind swaps is the model contract's list
(`blocks()`: each block's MLP linears, and its attention projections where `attention` says so).

  none            nn.Linear in the precision's compute dtype.
  switchback-*    SwitchBack int8 (Wortsman et al. 2023): forward and input-gradient matmuls in
                  int8, weight gradient 16-bit; Triton kernels on GPU, torch._int_mm on CPU.
  fp8-*           torchao's float8 training (all three matmuls in float8 with dynamic scales);
                  needs an fp8 GPU (compute capability 8.9+: Ada, Hopper) and torchao; on a CPU
                  torchao emulates it (same casts, high-precision matmul).
Every kind keeps the parameters' names, shapes and dtypes, so checkpoints and consolidated
weights do not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.errors import ConfigError
from bigclip.openclip_flags import bnb_linear_to_int8


@dataclass(frozen=True)
class LinearKind:
    name: str
    family: str  # "none", "switchback" or "fp8": the ops package that implements it
    variant: str  # SwitchBack's quantisation, or torchao's float8 recipe
    package: str  # the optional package it needs ("": none beyond torch)
    attention: str  # "optional": --int8-attention adds the attention projections; "always"; "never"


LINEAR_KINDS: dict[str, LinearKind] = {
    k.name: k
    for k in (
        LinearKind("none", "none", "", "", "never"),
        LinearKind("switchback-global", "switchback", "global", "", "optional"),
        LinearKind("switchback-vectorwise", "switchback", "vectorwise", "", "optional"),
        LinearKind("switchback-memefficient", "switchback", "memefficient", "", "optional"),
        LinearKind("fp8-tensorwise", "fp8", "tensorwise", "torchao", "always"),
        LinearKind("fp8-rowwise", "fp8", "rowwise", "torchao", "always"),
    )
}
INT8_KINDS = tuple(name for name, k in LINEAR_KINDS.items() if k.family == "switchback")


def int8_alias_to_kind(value: str) -> str:
    """A value given through --int8 (a SwitchBack kind) or OpenCLIP's --use-bnb-linear (a
    bitsandbytes class name, converted or refused by `openclip_flags`), as a --linear-kind."""
    return value if value in INT8_KINDS else bnb_linear_to_int8(value)


def linear_kind(name: str) -> LinearKind:
    if name not in LINEAR_KINDS:
        raise ConfigError(f"--linear-kind {name!r} is unknown; choose from {', '.join(LINEAR_KINDS)}")
    return LINEAR_KINDS[name]
