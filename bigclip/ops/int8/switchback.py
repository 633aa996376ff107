"""SwitchBack int8 linear layers (Wortsman et al., 2023, arXiv:2304.13013) and the model swap.

A SwitchBack linear runs the forward matmul (x @ W^T) and the input-gradient matmul (g @ W) in
int8 with int32 accumulation and a fused dequantise + bias epilogue, and keeps the weight
gradient (g^T @ x, which sums over all tokens and is the most sensitive) in 16-bit: the dtype
the activations arrive in. Inputs and output gradients are quantised per row (per token);
the weight per tensor (`global`, one scale serves both matmuls) or per output row in forward
and per input column in backward (`vectorwise`). `memefficient` is `global` that saves the int8
input for the weight gradient instead of the 16-bit one (half the activation memory, and the
weight gradient sees the quantised input). Kernels: `custom_ops` (Triton on GPU, PyTorch
`torch._int_mm` on CPU); quantisation rules: `torch_path`.

Error bound. With a = absmax of input row m and b = absmax of the weight group used for output
n (the tensor, or row n), quantisation writes x_mk = a/127 (q_mk + e_mk) and w_nk = b/127
(p_nk + d_nk) with |e|, |d| <= 1/2 and |q| <= 127 |x| / a + 1/2. Expanding sum_k x_mk w_nk:
    |y_int8 - y| <= (b ||x_m||_1 + a ||w_n||_1) / 254 + 3 K a b / (4 * 127^2)
plus the rounding of y to the output dtype. Independent rounding errors (variance 1/12) give
the typical size, about sqrt(b^2 ||x_m||_2^2 + a^2 ||w_n||_2^2) / (127 sqrt(12)). The input
gradient obeys the same bounds with (g_m, column k of W). The weight and bias gradients are
exact matmuls, except in `memefficient`: |d grad_W[n, k]| <= sum_m |g_mn| a_m / 254.

Layers keep nn.Linear's parameters (same names, shapes, dtypes): FSDP2 and ZeRO-3 shard them
unchanged and state dicts load into plain models. Linears whose sizes are not multiples of 16
stay 16-bit (one warning). NaN/inf inputs turn their rows' outputs into NaN (never int8
garbage) and are counted on the device; `report_nonfinite_inputs` reads the counts.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bigclip.config.linear_kinds import INT8_KINDS, LINEAR_KINDS
from bigclip.errors import ConfigError
from bigclip.models.contract import LinearSlot
from bigclip.ops.int8 import custom_ops as ops

INT8_MODES = {name: LINEAR_KINDS[name].variant for name in INT8_KINDS}  # --linear-kind -> quantisation
_ALIGNMENT = 16  # kernel tiles and cuBLASLt int8 need sizes in multiples of 16 (resp. 8)
_MAX_FEATURES = 65536  # the row-wise quantiser holds one row per program
Model = TypeVar("Model", bound=nn.Module)


def int8_shape_supported(in_features: int, out_features: int) -> bool:
    return all(0 < f <= _MAX_FEATURES and f % _ALIGNMENT == 0 for f in (in_features, out_features))


class _SwitchBackFunction(torch.autograd.Function):
    """y = x @ W^T + b on 2-D x; int8 forward and input gradient, 16-bit weight gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, quantization: str):
        x_q, x_absmax = ops.quantize_rows(x)
        if quantization == "vectorwise":
            w_q, w_absmax = ops.quantize_rows(weight)
        else:
            w_q, w_absmax = ops.quantize_global(weight, False)
        out = ops.int8_matmul(x_q, w_q, x_absmax, w_absmax, bias, x.dtype)
        if quantization == "memefficient":
            ctx.save_for_backward(None, x_q, x_absmax, weight)
        else:  # saving the parameter itself lets FSDP2 / ZeRO-3 free and re-gather it as usual
            ctx.save_for_backward(x, None, None, weight)
        ctx.quantization = quantization
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(x_absmax)
        return out, x_absmax

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _: Tensor | None):
        x, x_q, x_absmax, weight = ctx.saved_tensors
        g = grad_out.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_w:  # first, so memefficient's dequantised input is freed before the int8 matmul
            x_hat = x if x is not None else ops.dequantize_rows(x_q, x_absmax, g.dtype)
            grad_w = (g.t() @ x_hat.to(g.dtype)).to(weight.dtype)
            del x_hat
        if need_b:
            grad_b = g.sum(dim=0).to(ctx.bias_dtype)
        if need_x:
            g_q, g_absmax = ops.quantize_rows(g)
            if ctx.quantization == "vectorwise":
                w_q, w_absmax = ops.quantize_columns_transposed(weight)
            else:
                w_q, w_absmax = ops.quantize_global(weight, True)
            grad_x = ops.int8_matmul(g_q, w_q, g_absmax, w_absmax, None, g.dtype)
        return grad_x, grad_w, grad_b, None


class NonfiniteTally:
    """Rows of NaN/inf input one layer has seen, counted on the device: no host sync per step."""

    def __init__(self) -> None:
        self.rows: Tensor | None = None

    def add(self, absmax: Tensor) -> None:
        bad = torch.isnan(absmax).sum()  # quantisation marks non-finite rows with absmax = NaN
        if self.rows is None or self.rows.device != bad.device:
            self.rows = torch.zeros((), dtype=torch.int64, device=bad.device)
        self.rows.add_(bad)


def _activation_dtype(x: Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def switchback_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    quantization: str = "global",
    tally: NonfiniteTally | None = None,
) -> Tensor:
    """F.linear in SwitchBack int8; returns the activation dtype (the autocast dtype under autocast)."""
    dtype = _activation_dtype(x)
    # Like F.linear under autocast: compute in the autocast dtype, gradients flow to the originals.
    x, weight = x.to(dtype), weight.to(dtype)
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] == 0:
        return F.linear(x, weight, bias)
    out, x_absmax = _SwitchBackFunction.apply(x2d.contiguous(), weight, bias, quantization)
    if tally is not None:
        tally.add(x_absmax)
    return out.view(*x.shape[:-1], weight.shape[0])


class SwitchBackLinear(nn.Linear):
    """nn.Linear whose forward runs SwitchBack int8; parameters, init and state dict unchanged."""

    quantization: ClassVar[str] = "global"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_int8()
        if not self.int8_supported:
            name = f"{type(self).__name__}({in_features}, {out_features})"
            warnings.warn(_fallback_message([name]), stacklevel=2)

    def _init_int8(self) -> None:
        self.int8_supported = int8_shape_supported(self.in_features, self.out_features)
        self.nonfinite = NonfiniteTally()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> SwitchBackLinear:
        """A SwitchBack layer holding `linear`'s own Parameter objects (works on the meta device)."""
        layer = cls.__new__(cls)
        layer.__dict__.update(linear.__dict__)  # same parameters, hooks, flags: only forward differs
        layer._init_int8()
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if not self.int8_supported:
            return F.linear(x, self.weight, self.bias)
        return switchback_linear(
            x, self.weight, self.bias, quantization=self.quantization, tally=self.nonfinite
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quantization={self.quantization}"


class SwitchBackLinearGlobal(SwitchBackLinear):
    quantization = "global"


class SwitchBackLinearVectorwise(SwitchBackLinear):
    quantization = "vectorwise"


class SwitchBackLinearGlobalMemEfficient(SwitchBackLinear):
    quantization = "memefficient"


LINEAR_CLASSES: dict[str, type[SwitchBackLinear]] = {
    "global": SwitchBackLinearGlobal,
    "vectorwise": SwitchBackLinearVectorwise,
    "memefficient": SwitchBackLinearGlobalMemEfficient,
}


class SwitchBackProjection:
    """Stands in for `Attention.in_proj` (called as in_proj(x, weight, bias)): the fused QKV
    projection, whose parameters live on the attention module itself."""

    def __init__(self, quantization: str) -> None:
        self.quantization = quantization
        self.nonfinite = NonfiniteTally()

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if not int8_shape_supported(weight.shape[1], weight.shape[0]):
            return F.linear(x, weight, bias)
        return switchback_linear(x, weight, bias, quantization=self.quantization, tally=self.nonfinite)

    def __repr__(self) -> str:
        return f"SwitchBackProjection(quantization={self.quantization})"


def _fallback_message(names: list[str]) -> str:
    return (
        f"SwitchBack int8 needs in/out features that are multiples of {_ALIGNMENT} (at most "
        f"{_MAX_FEATURES}); these stay 16-bit linears: {', '.join(names)}"
    )


def _swap(slot: LinearSlot, quantization: str, skipped: list[str]) -> None:
    if not int8_shape_supported(slot.in_features, slot.out_features):
        skipped.append(f"{slot.name} ({slot.in_features}->{slot.out_features})")
    elif slot.kind == "projection":
        setattr(slot.parent, slot.attr, SwitchBackProjection(quantization))
    elif type(getattr(slot.parent, slot.attr)) is not LINEAR_CLASSES[quantization]:
        setattr(
            slot.parent, slot.attr, LINEAR_CLASSES[quantization].from_linear(getattr(slot.parent, slot.attr))
        )


def apply_int8(
    model: Model, mode: str, *, include_attention: bool = False, slots: Sequence[LinearSlot] | None = None
) -> Model:
    """Swap the MLP linears the model contract lists (`swappable_linears()`: a CLIP's `mlp.c_fc`
    and `mlp.c_proj` in every block of both towers) for SwitchBack layers, and with
    `include_attention` the attention's projections too (a CLIP's fused QKV `attn.in_proj` and
    `attn.out_proj`). In place; returns the model.

    Works on meta-device models (no memory is touched) and inside `deepspeed.zero.Init`, and
    keeps every parameter's name, shape and identity: call it before sharding. `mode`: one of
    INT8_MODES. `slots`: exactly these of the contract's linears instead (the run's choice,
    models/from_config.py: by role and by the measured shape table).
    """
    if mode not in INT8_MODES:
        raise ConfigError(f"--int8 {mode!r} is not a SwitchBack mode; use one of {', '.join(INT8_MODES)}")
    if slots is None:
        slots = [s for s in model.swappable_linears() if s.role == "mlp" or include_attention]
    skipped: list[str] = []
    for slot in slots:
        _swap(slot, INT8_MODES[mode], skipped)
    if skipped:
        warnings.warn(_fallback_message(skipped), stacklevel=2)
    return model


def _tallies(model: nn.Module) -> dict[str, NonfiniteTally]:
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, SwitchBackLinear):
            found[name] = module.nonfinite
        if isinstance(getattr(module, "in_proj", None), SwitchBackProjection):
            found[f"{name}.in_proj"] = module.in_proj.nonfinite
    return {name: tally for name, tally in found.items() if tally.rows is not None}


def report_nonfinite_inputs(model: nn.Module, *, reset: bool = True) -> dict[str, int]:
    """Rows of NaN/inf input each int8 layer saw since the last reset (one device sync).

    Warns, naming the layers, when any are non-zero: those rows' outputs were NaN. Call it
    where the loop already syncs (logging), or when the loss turns non-finite.
    """
    tallies = _tallies(model)
    if not tallies:
        return {}
    counts = dict(zip(tallies, torch.stack([t.rows for t in tallies.values()]).tolist()))
    if reset:
        for tally in tallies.values():
            tally.rows.zero_()
    bad = {name: rows for name, rows in counts.items() if rows}
    if bad:
        warnings.warn(
            f"SwitchBack int8 layers received NaN/inf inputs (rows per layer: {bad}; the first "
            f"in model order, {next(iter(bad))}, is nearest to where they arose); those rows' "
            "outputs are NaN. Training is diverging or the data holds non-finite values: check "
            "the inputs, lower --lr or set --grad-clip-norm.",
            stacklevel=2,
        )
    return bad
