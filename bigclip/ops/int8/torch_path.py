"""SwitchBack's int8 primitives in plain PyTorch: the CPU path and the reference for the Triton kernels.

Quantisation is symmetric absmax with 127 levels over a group (a row, a column or the tensor):
    absmax = max |x| over the group, in fp32, floored at TINY
    q      = clamp(round_half_to_even(x * (127 / absmax)), -127, 127)      (int8)
    x     ~= q * (absmax / 127)
A group holding NaN or +-inf gets absmax = NaN and q = 0: anything computed from it dequantises
to NaN, so non-finite values propagate as they would through nn.Linear instead of being rounded
into plausible int8 garbage (`switchback.report_nonfinite_inputs` names the layers that saw them).

The int8 matmul accumulates exactly in int32 (|sum| <= 127^2 * K < 2^31 for K < 133,000) and
dequantises in fp32:  out[m, n] = acc[m, n] * (a_absmax[m] * INV127) * (b_absmax[n] * INV127) + bias[n],
INV127 = fp32(1 / 127).

`bigclip.ops.int8.kernels` implements the same functions, with the same arithmetic in the
same order, as Triton kernels: its int8 and int32 values equal these bit for bit.
"""

from __future__ import annotations

import torch

# Smallest absmax a group is given, so an all-zero group quantises to zeros instead of 0/0 = NaN.
# 127 / TINY must stay finite in fp32, and any group this small is zero for training purposes.
TINY = 1e-30
# Rows the CUDA int8 GEMM (cuBLASLt through torch._int_mm) needs at least; CPU has no minimum.
_CUDA_MIN_ROWS = 17
# Dequantisation multiplies by fp32(1/127) rather than dividing by 127: torch turns division by a
# scalar into that multiplication on some devices and not others, the kernels must match exactly.
INV127 = 1.0 / 127.0


def group_absmax(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """fp32 absmax over `dim` (None: the whole tensor); NaN for groups holding NaN or +-inf."""
    # One pass, no |x| temporary; min/max are exact in any float dtype and propagate NaN.
    low, high = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    absmax = torch.maximum(-low, high).float()
    return torch.where(torch.isfinite(absmax), absmax.clamp_min(TINY), torch.nan)


def _quantize(x: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """q = clamp(round(x * (127 / absmax))) with `absmax` already broadcastable against `x`."""
    # Tensor / tensor is IEEE division; `127.0 / t` would be reciprocal(t) * 127, rounded twice.
    scale = absmax.new_full((), 127.0) / absmax
    scaled = (x.float() * scale).round_()  # round half to even, as the kernels do
    return scaled.nan_to_num_(nan=0.0).clamp_(-127.0, 127.0).to(torch.int8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise: x [M, K] -> (q int8 [M, K], absmax fp32 [M])."""
    absmax = group_absmax(x, dim=1)
    return _quantize(x, absmax[:, None]), absmax


def quantize_global(w: torch.Tensor, *, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor-wise: w [N, K] -> (q int8 [N, K], or [K, N] contiguous if `transpose`; absmax fp32 [])."""
    absmax = group_absmax(w, dim=None)
    q = _quantize(w, absmax)
    return (q.t().contiguous() if transpose else q), absmax


def quantize_columns_transposed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise, written transposed: w [N, K] -> (q int8 [K, N] contiguous, absmax fp32 [K])."""
    absmax = group_absmax(w, dim=0)
    return _quantize(w, absmax[None, :]).t().contiguous(), absmax


def dequantize_rows(q: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_rows`: q [M, K] -> q * absmax / 127 in `dtype`."""
    return (q.float() * (absmax * INV127)[:, None]).to(dtype)


def int8_matmul_int32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T in int8 with exact int32 accumulation."""
    return int_mm_padded(a, b, min_rows=_CUDA_MIN_ROWS if a.is_cuda else 0)


def int_mm_padded(a: torch.Tensor, b: torch.Tensor, *, min_rows: int) -> torch.Tensor:
    """torch._int_mm(a, b^T) with `a` padded to at least `min_rows` rows (CUDA's minimum)."""
    rows = a.shape[0]
    if rows < min_rows:
        # Zero rows contribute zero rows: padding is exact, and cheaper than a 16-bit detour.
        a = torch.cat([a, a.new_zeros(min_rows - rows, a.shape[1])])
    return torch._int_mm(a, b.t())[:rows]


def int8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_absmax: torch.Tensor,
    b_absmax: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantised a [M, K] @ b [N, K]^T (+ bias): `a_absmax` [M], `b_absmax` [N] or [] (tensor-wise)."""
    acc = int8_matmul_int32(a, b).float()
    b_factor = b_absmax * INV127
    out = acc * (a_absmax * INV127)[:, None] * (b_factor[None, :] if b_factor.dim() else b_factor)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
