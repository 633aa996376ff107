"""Triton kernels for SwitchBack: row-wise and tensor-/column-wise int8 quantisation (optionally
written transposed), row-wise dequantisation, and an int8 GEMM with int32 accumulation whose
epilogue dequantises and adds the bias.

Every function has the signature and the exact arithmetic of its twin in
`bigclip.ops.int8.torch_path` (see that module for the quantisation rules): int8 and int32
results are bit-identical, which the tests check under TRITON_INTERPRET=1 on CPU. To keep
them identical on GPUs too, kernels launch with `enable_fp_fusion=False` (no mul+add -> FMA
contraction), divide with `div_rn` (IEEE, not the approximate default) and round half to even
with the 1.5 * 2^23 trick (exact for |y| < 2^22; libdevice's rint has no interpreter version).

Both GEMM operands are K-major (out = a @ b^T with a [M, K] and b [N, K] row-major), the
layout int8 tensor cores take natively; the backward pass therefore quantises the weight
straight into its transposed layout instead of transposing int8 data afterwards.
Group absmaxes that span many rows (tensor-wise, column-wise) come from torch's reductions.
Under the interpreter the GEMM runs one small tile; `launch_as_gpu` runs any of the GPU's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bigclip.ops.int8 import interpreter_compat
from bigclip.ops.int8.torch_path import INV127, TINY, group_absmax

_ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2^23: fp32 adds round to integers here
_FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
_TINY: tl.constexpr = tl.constexpr(TINY)
_INV127: tl.constexpr = tl.constexpr(INV127)
_LAUNCH = {"enable_fp_fusion": False}
_MAX_ROW = 65536  # one program holds a whole row in registers


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if interpreting():
    interpreter_compat.install()  # Triton 3.6's interpreter under NumPy >= 2.4: see that module


@triton.jit
def _round_clamp_int8(y):
    """round-half-even(y) clamped to [-127, 127] as int8; NaN (a non-finite group) becomes 0."""
    y = tl.where(y == y, y, 0.0)
    y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
    return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, absmax_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    finite = tl.abs(x) <= _FLT_MAX  # False for NaN and +-inf
    absmax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=0)
    bad = tl.max(tl.where(finite | ~inside, 0, 1), axis=0)
    absmax = tl.where(bad > 0, float("nan"), tl.maximum(absmax, _TINY))
    scale = tl.math.div_rn(tl.full((), 127.0, tl.float32), absmax)
    tl.store(q_ptr + row * n_cols + cols, _round_clamp_int8(x * scale), mask=inside)
    tl.store(absmax_ptr + row, absmax)


@triton.jit
def _quantize_tiles_kernel(
    w_ptr,
    q_ptr,
    absmax_ptr,
    n_rows,
    n_cols,
    PER_COLUMN: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    w = tl.load(w_ptr + rows[:, None] * n_cols + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if PER_COLUMN:
        absmax = tl.load(absmax_ptr + cols, mask=cols < n_cols, other=1.0)[None, :]
    else:
        absmax = tl.load(absmax_ptr)
    q = _round_clamp_int8(w * tl.math.div_rn(tl.full(absmax.shape, 127.0, tl.float32), absmax))
    if TRANSPOSE:
        tl.store(q_ptr + cols[None, :] * n_rows + rows[:, None], q, mask=inside)
    else:
        tl.store(q_ptr + rows[:, None] * n_cols + cols[None, :], q, mask=inside)


@triton.jit
def _dequantize_rows_kernel(q_ptr, absmax_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    q = tl.load(q_ptr + row * n_cols + cols, mask=inside, other=0).to(tl.float32)
    factor = tl.load(absmax_ptr + row) * _INV127
    tl.store(out_ptr + row * n_cols + cols, (q * factor).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _int8_matmul_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    a_absmax_ptr,
    b_absmax_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    DEQUANTIZE: tl.constexpr,
    B_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row-blocks share each column-block of b while it is in L2.
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    group_rows = tl.minimum(grid_m - group * GROUP_M, GROUP_M)
    pid_m = group * GROUP_M + (pid % group_rows)
    pid_n = (pid % (GROUP_M * grid_n)) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns read valid memory (wrapped) and are masked at the store.
    a_rows = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M).to(tl.int64)
    b_rows = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N).to(tl.int64)
    a_tile = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
    b_tile = b_ptr + b_rows[None, :] * stride_bn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_tile)
            b = tl.load(b_tile)
        else:
            remaining = K - k * BLOCK_K
            a = tl.load(a_tile, mask=rk[None, :] < remaining, other=0)
            b = tl.load(b_tile, mask=rk[:, None] < remaining, other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
        a_tile += BLOCK_K
        b_tile += BLOCK_K
    rm64 = rm.to(tl.int64)
    out_tile = out_ptr + rm64[:, None] * stride_om + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    if DEQUANTIZE:
        out = acc.to(tl.float32) * (tl.load(a_absmax_ptr + a_rows) * _INV127)[:, None]
        if B_PER_ROW:
            out = out * (tl.load(b_absmax_ptr + b_rows) * _INV127)[None, :]
        else:
            out = out * (tl.load(b_absmax_ptr) * _INV127)
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + b_rows).to(tl.float32)[None, :]
        tl.store(out_tile, out.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(out_tile, acc, mask=inside)


def _gemm_config(block_m: int, block_n: int, block_k: int, stages: int, warps: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
        num_stages=stages,
        num_warps=warps,
    )


# Tile shapes for int8 GEMMs on Ampere/Hopper tensor cores, large-K first; tuned per (M, N, K).
GEMM_CONFIGS = (
    _gemm_config(128, 256, 128, 3, 8),
    _gemm_config(256, 128, 128, 3, 8),
    _gemm_config(128, 128, 128, 4, 8),
    _gemm_config(128, 128, 128, 4, 4),
    _gemm_config(128, 256, 64, 4, 8),
    _gemm_config(256, 128, 64, 4, 8),
    _gemm_config(128, 128, 64, 4, 4),
    _gemm_config(64, 128, 128, 4, 4),
    _gemm_config(128, 64, 128, 4, 4),
)
_int8_matmul_tuned = triton.autotune(configs=list(GEMM_CONFIGS), key=["M", "N", "K", "DEQUANTIZE"])(
    _int8_matmul_kernel
)


@dataclass(frozen=True)
class _Launch:
    """How the GEMM and the weight quantiser launch."""

    gemm: triton.Config | None  # one fixed tile, or None: autotune over GEMM_CONFIGS
    even_k_blocks: tuple[int, ...]  # EVEN_K (no K masks) iff K is a multiple of all of these
    weight_tile: int  # BLOCK_R = BLOCK_C of the weight quantiser


_GPU_EVEN_K = tuple(sorted({c.kwargs["BLOCK_K"] for c in GEMM_CONFIGS}))
_GPU_LAUNCH = _Launch(gemm=None, even_k_blocks=_GPU_EVEN_K, weight_tile=64)
# The interpreter runs every program in Python: one small fixed tile, no autotuning.
_INTERPRETER_LAUNCH = _Launch(
    gemm=triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}),
    even_k_blocks=(32,),
    weight_tile=32,
)
_forced: list[_Launch] = []


def _launch() -> _Launch:
    if _forced:
        return _forced[-1]
    return _INTERPRETER_LAUNCH if interpreting() else _GPU_LAUNCH


@contextlib.contextmanager
def launch_as_gpu(gemm_config: triton.Config | None) -> Iterator[None]:
    """Launch the kernels as on a GPU (its weight tiles, its EVEN_K rule), with the GEMM fixed to
    `gemm_config` (one of GEMM_CONFIGS) instead of autotuned, or autotuned if None (GPU only).
    Lets the interpreter run every tile the GPU may pick, and a GPU check each one of them."""
    if gemm_config is None and interpreting():
        raise ValueError("the interpreter cannot autotune: pass one of GEMM_CONFIGS")
    _forced.append(_Launch(gemm=gemm_config, even_k_blocks=_GPU_EVEN_K, weight_tile=64))
    try:
        yield
    finally:
        _forced.pop()


def _launch_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, **kwargs) -> torch.Tensor:
    (m, k), n = a.shape, b.shape[0]
    if a.stride(1) != 1 or b.stride(1) != 1 or b.shape[1] != k:
        raise ValueError(f"int8 GEMM needs K-major operands a [M, K], b [N, K]; got {a.shape}, {b.shape}")
    if m == 0 or n == 0:
        return out
    args = (a, b, out, kwargs.pop("a_absmax", a), kwargs.pop("b_absmax", b), kwargs.pop("bias", None))
    args += (m, n, k, a.stride(0), b.stride(0), out.stride(0))
    launch = _launch()
    kwargs |= {"EVEN_K": all(k % block == 0 for block in launch.even_k_blocks), **_LAUNCH}

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    if launch.gemm is None:
        _int8_matmul_tuned[grid](*args, **kwargs)
        return out
    cfg = launch.gemm
    warps = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _int8_matmul_kernel[grid(cfg.kwargs)](*args, **kwargs, **cfg.kwargs, **warps)
    return out


def int8_matmul_int32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T in int8 with exact int32 accumulation."""
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.int32, device=a.device)
    return _launch_gemm(a, b, out, DEQUANTIZE=False, B_PER_ROW=False, HAS_BIAS=False)


def int8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_absmax: torch.Tensor,
    b_absmax: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantised a [M, K] @ b [N, K]^T (+ bias): `a_absmax` [M], `b_absmax` [N] or [] (tensor-wise)."""
    out = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    per_row = b_absmax.dim() == 1
    return _launch_gemm(
        a,
        b,
        out,
        a_absmax=a_absmax,
        b_absmax=b_absmax,
        bias=bias if bias is not None else b_absmax,
        DEQUANTIZE=True,
        B_PER_ROW=per_row,
        HAS_BIAS=bias is not None,
    )


def _row_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise: x [M, K] -> (q int8 [M, K], absmax fp32 [M])."""
    if x.stride(1) != 1 or x.shape[1] > _MAX_ROW:
        raise ValueError(f"row-wise quantisation needs unit column stride and K <= {_MAX_ROW}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    absmax = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        launch = {} if interpreting() else {"num_warps": _row_warps(block)}
        _quantize_rows_kernel[(m,)](x, q, absmax, k, x.stride(0), BLOCK=block, **launch, **_LAUNCH)
    return q, absmax


def _quantize_tiles(
    w: torch.Tensor, absmax: torch.Tensor, *, per_column: bool, transpose: bool
) -> torch.Tensor:
    w = w.contiguous()
    rows, cols = w.shape
    q = torch.empty((cols, rows) if transpose else (rows, cols), dtype=torch.int8, device=w.device)
    tile = _launch().weight_tile
    grid = (triton.cdiv(rows, tile), triton.cdiv(cols, tile))
    _quantize_tiles_kernel[grid](
        w, q, absmax, rows, cols, PER_COLUMN=per_column, TRANSPOSE=transpose,
        BLOCK_R=tile, BLOCK_C=tile, **_LAUNCH,
    )  # fmt: skip
    return q


def quantize_global(w: torch.Tensor, *, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor-wise: w [N, K] -> (q int8 [N, K], or [K, N] contiguous if `transpose`; absmax fp32 [])."""
    absmax = group_absmax(w, dim=None)
    return _quantize_tiles(w, absmax, per_column=False, transpose=transpose), absmax


def quantize_columns_transposed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise, written transposed: w [N, K] -> (q int8 [K, N] contiguous, absmax fp32 [K])."""
    absmax = group_absmax(w, dim=0)
    return _quantize_tiles(w, absmax, per_column=True, transpose=True), absmax


def dequantize_rows(q: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_rows`: q [M, K] -> q * absmax / 127 in `dtype`."""
    q = q.contiguous()
    m, k = q.shape
    out = torch.empty(m, k, dtype=dtype, device=q.device)
    if m and k:
        block = min(triton.next_power_of_2(k), 1024)
        _dequantize_rows_kernel[(m, triton.cdiv(k, block))](q, absmax, out, k, BLOCK=block, **_LAUNCH)
    return out
