"""The linear kinds a run can put in its residual blocks' linears, declared once.

`--linear-kind` picks one; config validation, the model swap (`models/from_config.py`), the
machine check (`train/preflight.py`), the planner and the tests read this table. Each kind names
the module that implements it (`implementation`, e.g. `bigclip.ops.int8.linear_kind`), which
provides `check_machine(kind, device_type)` (a ConfigError where the machine cannot run it) and
`apply(model, kind, *, slots, device_type)` (swaps exactly `slots`, the run's choice among the
model contract's `swappable_linears()`: each block's MLP linears and, where `attention` says so,
its attention projections, those of them the measured shape table says are faster
(config/linear_speedups.py, `--linear-filter`); returns the line the run prints). A new kind is
that module and one `register_linear_kind` (docs/extending.md).

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


@dataclass(frozen=True)
class LinearKind:
    name: str
    family: str  # "none", "switchback" or "fp8": kinds of one implementation
    variant: str  # SwitchBack's quantisation, or torchao's float8 recipe
    package: str  # the optional package it needs ("": none beyond torch)
    attention: str  # "optional": --int8-attention adds the attention projections; "always"; "never"
    implementation: str = ""  # the module with check_machine and apply ("": plain nn.Linear)
    int8_saved_inputs: bool = False  # saves its inputs for backward as int8 + absmax (the planner's term)

    def includes_attention(self, int8_attention: bool) -> bool:
        return self.attention == "always" or (self.attention == "optional" and int8_attention)


LINEAR_KINDS: dict[str, LinearKind] = {}


def register_linear_kind(kind: LinearKind) -> LinearKind:
    """Make `kind` a --linear-kind value (before flags are parsed: its own module's import)."""
    LINEAR_KINDS[kind.name] = kind
    return kind


_SWITCHBACK, _FP8 = "bigclip.ops.int8.linear_kind", "bigclip.ops.fp8.linear_kind"
for _kind in (
    LinearKind("none", "none", "", "", "never"),
    LinearKind("switchback-global", "switchback", "global", "", "optional", _SWITCHBACK),
    LinearKind("switchback-vectorwise", "switchback", "vectorwise", "", "optional", _SWITCHBACK),
    LinearKind("switchback-memefficient", "switchback", "memefficient", "", "optional", _SWITCHBACK, True),
    LinearKind("fp8-tensorwise", "fp8", "tensorwise", "torchao", "always", _FP8),
    LinearKind("fp8-rowwise", "fp8", "rowwise", "torchao", "always", _FP8),
):
    register_linear_kind(_kind)
INT8_KINDS = tuple(name for name, k in LINEAR_KINDS.items() if k.family == "switchback")


def linear_kind(name: str) -> LinearKind:
    if name not in LINEAR_KINDS:
        raise ConfigError(f"--linear-kind {name!r} is unknown; choose from {', '.join(LINEAR_KINDS)}")
    return LINEAR_KINDS[name]
