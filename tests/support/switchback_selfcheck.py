"""SwitchBack's Triton kernels against its PyTorch path on one device: which result disagrees,
and by how much.

A check runs one function of `kernels` and its twin in `torch_path` on the same inputs, or
the whole layer (forward and backward) once per backend, each on its own deep copy of the same
nn.Linear, so no gradient of one run lands in the other's `.grad`. Each compared tensor gives
one row: the fraction of elements that differ and the largest difference, absolute and in
units in the last place (ulps) of the expected value, in the dtype the layer computes in. All
must be identical (ALLOWED_ULPS = 0): the kernels do PyTorch's arithmetic in the same order, with
no FMA contraction and IEEE division (see `kernels`), and under TRITON_INTERPRET=1 the
interpreter rounds to bf16 as GPUs do (`interpreter_compat`).

Used by the GPU diagnostic (benchmarks/switchback_diagnose.py), the GPU tests, and the
interpreter tests (CPU, TRITON_INTERPRET=1): test code, so it lives beside the tests.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bigclip.ops.int8.custom_ops import BACKEND_ENV
from bigclip.ops.int8.switchback import LINEAR_CLASSES

ALLOWED_ULPS = 0.0
LAYER_OUTPUTS = ("y", "grad_x", "grad_w", "grad_b")
GRAD_LAYOUTS = ("contiguous", "transposed", "strided", "expanded")
_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


def _ulps(got: Tensor, want: Tensor, dtype: torch.dtype) -> Tensor:
    """|got - want| in ulps of `dtype` at |want| (equal NaNs and infs: 0; unequal: inf)."""
    g, w = got.double(), want.double()
    # float64 log2 of an fp32 value never rounds across a power of two: floor is its exponent
    exponent = w.abs().clamp_min(torch.finfo(dtype).tiny).log2().floor()
    ulp = 2.0 ** (exponent - _MANTISSA_BITS[dtype])
    diff = ((g - w).abs() / ulp).nan_to_num(nan=math.inf, posinf=math.inf)
    same = (g == w) | (g.isnan() & w.isnan())
    return torch.where(same, 0.0, diff)


def compare(
    check: str,
    got: Tensor,
    want: Tensor,
    *,
    allowed_ulps: float = ALLOWED_ULPS,
    ulp_dtype: torch.dtype | None = None,
) -> dict:
    """One row of the report: `got` (Triton) against `want` (PyTorch); ulps of `ulp_dtype`, the
    dtype the value was rounded to (default: `want`'s; a 16-bit result cast to fp32 differs)."""
    row = {"check": check, "shape": "x".join(map(str, want.shape)), "dtype": str(want.dtype)[6:]}
    if got.shape != want.shape or got.dtype != want.dtype:
        return row | {"ok": False, "detail": f"got {tuple(got.shape)} {got.dtype}"}
    if want.is_floating_point():
        diff, allowed = _ulps(got, want, ulp_dtype or want.dtype), allowed_ulps
    else:
        diff, allowed = (got.long() - want.long()).abs().double(), 0.0
    finite = (got.double() - want.double()).abs().nan_to_num(nan=0.0, posinf=0.0)
    row |= {
        "differ": round(diff.gt(0).double().mean().item(), 6) if diff.numel() else 0.0,
        "max_abs": finite.max().item() if finite.numel() else 0.0,
        "max_ulps": diff.max().item() if diff.numel() else 0.0,
        "allowed_ulps": allowed,
    }
    return row | {"ok": row["max_ulps"] <= allowed, "detail": ""}


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run SwitchBack's primitives on `name` ('triton' or 'torch') inside the block."""
    before = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before


@dataclass(frozen=True)
class LayerCase:
    """One call of a SwitchBack layer as a model makes it, forward and backward."""

    quantization: str
    lead: tuple[int, ...]  # x is [*lead, in_features]: tokens = prod(lead)
    in_features: int
    out_features: int
    param_dtype: torch.dtype = torch.bfloat16
    autocast: torch.dtype | None = None  # mixed precision: fp32 parameters, 16-bit compute
    bias: bool = True
    permuted_input: bool = False  # x a transposed view of its leaf ([L, B, K] -> [B, L, K])
    grad_layout: str = "contiguous"  # of the gradient handed to backward: see GRAD_LAYOUTS

    @property
    def name(self) -> str:
        dtype = f"autocast-{self.autocast}" if self.autocast else str(self.param_dtype)
        shape = f"{'x'.join(map(str, self.lead))}x{self.in_features}->{self.out_features}"
        extras = ["permuted-x"] * self.permuted_input + ["no-bias"] * (not self.bias)
        return "-".join([self.quantization, dtype.replace("torch.", ""), shape, self.grad_layout, *extras])


def _grad(case: LayerCase, shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> Tensor:
    if case.grad_layout == "transposed":  # every dimension reversed in memory: column-major
        return torch.randn(shape[::-1], generator=g).to(dtype).permute(*reversed(range(len(shape))))
    if case.grad_layout == "strided":
        return torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(dtype)[..., ::2]
    if case.grad_layout == "expanded":  # stride 0, as a broadcast in the next op gives
        return torch.randn(shape[-1], generator=g).to(dtype).expand(shape)
    if case.grad_layout != "contiguous":
        raise ValueError(f"grad_layout {case.grad_layout!r}: use one of {GRAD_LAYOUTS}")
    return torch.randn(shape, generator=g).to(dtype)


def layer_inputs(case: LayerCase, device: torch.device, *, seed: int = 0) -> tuple[nn.Linear, Tensor, Tensor]:
    """The nn.Linear both backends copy, x's leaf (before any view) and the output gradient."""
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(case.in_features, case.out_features, case.bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) / math.sqrt(case.in_features))
        if case.bias:
            linear.bias.copy_(torch.randn(case.out_features, generator=g))
    lead = case.lead[::-1] if case.permuted_input else case.lead
    compute = case.autocast or case.param_dtype
    x_leaf = torch.randn(*lead, case.in_features, generator=g).to(case.param_dtype)
    grad = _grad(case, (*case.lead, case.out_features), compute, g)
    return linear.to(device, case.param_dtype), x_leaf.to(device), grad.to(device)


def layer_outputs(case: LayerCase, linear: nn.Linear, x_leaf: Tensor, grad: Tensor, name: str) -> dict:
    """y and the three gradients of one backend's run, on a fresh copy of `linear`."""
    layer = LINEAR_CLASSES[case.quantization].from_linear(copy.deepcopy(linear))
    leaf = x_leaf.detach().clone().requires_grad_()
    x = leaf.transpose(0, 1) if case.permuted_input else leaf
    autocast = torch.autocast(x.device.type, dtype=case.autocast, enabled=case.autocast is not None)
    with backend(name), autocast:
        y = layer(x)
    with backend(name):
        y.backward(grad)
    bias_grad = layer.bias.grad if case.bias else torch.zeros(0)
    return dict(zip(LAYER_OUTPUTS, (y.detach(), leaf.grad, layer.weight.grad, bias_grad)))


def check_layer(case: LayerCase, device: torch.device, *, seed: int = 0) -> list[dict]:
    """The layer's four outputs on Triton against the PyTorch path: one row each."""
    inputs = layer_inputs(case, device, seed=seed)
    got = layer_outputs(case, *inputs, "triton")
    want = layer_outputs(case, *inputs, "torch")
    compute = case.autocast or case.param_dtype
    return [
        compare(f"layer {case.name}: {key}", got[key], want[key], ulp_dtype=compute) for key in LAYER_OUTPUTS
    ]


def failures(rows: list[dict]) -> str:
    """The rows that disagree, one line each, for an assertion message ('' if none)."""
    return "\n".join(
        f"{r['check']}: {r.get('differ', 1.0):.2%} of {r['shape']} {r['dtype']} differ, max abs "
        f"{r.get('max_abs', math.nan):.4g} = {r.get('max_ulps', math.nan):.4g} ulps {r['detail']}".rstrip()
        for r in rows
        if not r["ok"]
    )


def hard_rows(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> Tensor:
    """Gaussian rows plus the awkward ones: zeros, tiny values, an outlier, exact ties, NaN, -inf."""
    x = torch.randn(rows, cols, generator=g)
    x[1], x[2] = 0.0, x[2] * 1e-6
    x[3, 5] = 300.0
    x[4, :4], x[4, 4:] = torch.tensor([127.0, 0.5, 1.5, -2.5]), 0.0
    x[5, 7], x[6, 1] = float("nan"), float("-inf")
    return x.to(dtype)


def _quantizer_checks(x: Tensor, w: Tensor, grad: Tensor) -> dict:
    """Every quantiser call the layer makes, forward and backward, by name."""
    return {
        "fwd quantize_rows(x)": lambda m: m.quantize_rows(x),
        "fwd quantize_rows(w) [vectorwise]": lambda m: m.quantize_rows(w),
        "fwd quantize_global(w)": lambda m: m.quantize_global(w, transpose=False),
        "bwd quantize_rows(grad)": lambda m: m.quantize_rows(grad),
        "bwd quantize_columns_transposed(w) [vectorwise]": lambda m: m.quantize_columns_transposed(w),
        "bwd quantize_global(w, transpose) [global]": lambda m: m.quantize_global(w, transpose=True),
    }


def check_quantizers(m: int, n: int, k: int, device: torch.device, *, seed: int = 0) -> list[dict]:
    """Row-wise, tensor-wise and column-wise quantisation, and the dequantisation memefficient's
    backward runs: x [m, k], w [n, k] and the output gradient [m, n], all bf16."""
    from bigclip.ops.int8 import kernels, torch_path

    g = torch.Generator().manual_seed(seed)
    x, grad = hard_rows(m, k, torch.bfloat16, g), hard_rows(m, n, torch.bfloat16, g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x, w, grad = x.to(device), w.to(device), grad.to(device)
    rows = []
    for name, run in _quantizer_checks(x, w, grad).items():
        for part, got, want in zip(("q", "absmax"), run(kernels), run(torch_path)):
            rows.append(compare(f"{name}: {part}", got, want))
    x_q, x_absmax = torch_path.quantize_rows(x)
    for dtype in (torch.bfloat16, torch.float32):
        got = kernels.dequantize_rows(x_q, x_absmax, dtype)
        rows.append(
            compare(
                "bwd dequantize_rows(x_q) [memefficient]",
                got,
                torch_path.dequantize_rows(x_q, x_absmax, dtype),
            )
        )
    return rows


def _gemm_operands(m: int, n: int, k: int, device: torch.device, g: torch.Generator) -> dict:
    """Quantised forward (x, w) and backward (grad, w^T) operands as the layer builds them."""
    from bigclip.ops.int8 import torch_path as ref

    x, grad = hard_rows(m, k, torch.bfloat16, g).to(device), hard_rows(m, n, torch.bfloat16, g).to(device)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).to(device)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).to(device)
    x_q, x_absmax = ref.quantize_rows(x)
    g_q, g_absmax = ref.quantize_rows(grad)
    return {
        "fwd y [global]": (x_q, *_swap(ref.quantize_global(w, transpose=False), x_absmax), bias),
        "fwd y [vectorwise]": (x_q, *_swap(ref.quantize_rows(w), x_absmax), bias),
        "bwd grad_x [global]": (g_q, *_swap(ref.quantize_global(w, transpose=True), g_absmax), None),
        "bwd grad_x [vectorwise]": (g_q, *_swap(ref.quantize_columns_transposed(w), g_absmax), None),
    }


def _swap(b: tuple[Tensor, Tensor], a_absmax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    b_q, b_absmax = b
    return b_q, a_absmax, b_absmax


def _random_int8(rows: int, cols: int, g: torch.Generator) -> Tensor:
    return (torch.randn(rows, cols, generator=g) * 64).round().clamp(-127, 127).to(torch.int8)


def check_gemms(m: int, n: int, k: int, device: torch.device, *, label: str, seed: int = 0) -> list[dict]:
    """The int8 GEMM, bare (int32) and with each dequantising epilogue the layer uses, under the
    current launch (see kernels.launch_as_gpu); `label` names that launch in the rows."""
    from bigclip.ops.int8 import kernels, torch_path

    g = torch.Generator().manual_seed(seed)
    a, b = (_random_int8(rows, k, g).to(device) for rows in (m, n))
    a[0], b[0] = 127, -127  # the largest sums
    rows = [
        compare(f"gemm int32 {label}", kernels.int8_matmul_int32(a, b), torch_path.int8_matmul_int32(a, b))
    ]
    for name, (a_q, b_q, a_absmax, b_absmax, bias) in _gemm_operands(m, n, k, device, g).items():
        got = kernels.int8_matmul(a_q, b_q, a_absmax, b_absmax, bias, torch.bfloat16)
        want = torch_path.int8_matmul(a_q, b_q, a_absmax, b_absmax, bias, torch.bfloat16)
        rows.append(compare(f"gemm {name} {label}", got, want))
    return rows
