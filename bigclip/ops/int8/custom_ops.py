"""SwitchBack's int8 primitives as torch custom ops, each dispatched to a backend at call time.

Backends: `bigclip.ops.int8.kernels` (Triton: CUDA tensors, or any tensor under
TRITON_INTERPRET=1) and `bigclip.ops.int8.torch_path` (PyTorch, `torch._int_mm`: CPU, and CUDA
when Triton is missing). BIGCLIP_SWITCHBACK_BACKEND=auto|torch|triton overrides the choice.

Registering them as custom ops (with shape-only "fake" versions) lets torch.compile treat each
one as an opaque node instead of tracing Triton launch code, and lets them run on the meta
device. The functions here are what the autograd code in `bigclip.ops.int8.switchback` calls.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType

import torch
from torch import Tensor

from bigclip.errors import ConfigError
from bigclip.ops.int8 import torch_path

BACKEND_ENV = "BIGCLIP_SWITCHBACK_BACKEND"
BACKENDS = ("auto", "torch", "triton")


@functools.cache
def _triton_kernels() -> ModuleType | None:
    try:
        from bigclip.ops.int8 import kernels
    except ImportError as err:  # no triton on this platform: the PyTorch path still works
        warnings.warn(f"SwitchBack: Triton unavailable ({err}); using the PyTorch int8 path", stacklevel=3)
        return None
    return kernels


def backend_for(t: Tensor) -> ModuleType:
    """The module implementing the primitives for tensors like `t`."""
    return _select(cuda=t.is_cuda)


def _select(*, cuda: bool) -> ModuleType:
    choice = os.environ.get(BACKEND_ENV, "auto")
    if choice not in BACKENDS:
        raise ConfigError(f"{BACKEND_ENV}={choice!r}: use one of {', '.join(BACKENDS)}")
    if choice == "torch" or (choice == "auto" and not cuda):
        return torch_path
    kernels = _triton_kernels()
    if kernels is None:
        if choice == "triton":
            raise ConfigError(f"{BACKEND_ENV}=triton but triton cannot be imported; pip install triton")
        return torch_path
    if not cuda and not kernels.interpreting():
        raise ConfigError(f"{BACKEND_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1 (set before import)")
    return kernels


def describe_path(device_type: str) -> str:
    """Which code runs SwitchBack's int8 matmuls for a run on `device_type` ("cuda" or "cpu"), and
    why: the log line a run prints at start (the choice `backend_for` makes at each call)."""
    cuda = device_type == "cuda"
    chosen = _select(cuda=cuda)
    if chosen is not torch_path:
        import triton

        where = "under Triton's CPU interpreter (TRITON_INTERPRET=1)" if not cuda else "on the GPU"
        return f"bigclip's Triton kernels (triton {triton.__version__}) {where}"
    choice = os.environ.get(BACKEND_ENV, "auto")
    why = (
        f"{BACKEND_ENV}=torch" if choice == "torch"
        else "Triton runs on CUDA tensors, and this run computes on the CPU" if not cuda
        else "Triton cannot be imported here (pip install triton)"
    )  # fmt: skip
    return f"the PyTorch path (torch._int_mm): {why}"


@torch.library.custom_op("bigclip::switchback_quantize_rows", mutates_args=())
def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    return backend_for(x).quantize_rows(x)


@quantize_rows.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("bigclip::switchback_quantize_global", mutates_args=())
def quantize_global(w: Tensor, transpose: bool) -> tuple[Tensor, Tensor]:
    return backend_for(w).quantize_global(w, transpose=transpose)


@quantize_global.register_fake
def _(w: Tensor, transpose: bool) -> tuple[Tensor, Tensor]:
    shape = (w.shape[1], w.shape[0]) if transpose else w.shape
    return w.new_empty(shape, dtype=torch.int8), w.new_empty((), dtype=torch.float32)


@torch.library.custom_op("bigclip::switchback_quantize_columns_transposed", mutates_args=())
def quantize_columns_transposed(w: Tensor) -> tuple[Tensor, Tensor]:
    return backend_for(w).quantize_columns_transposed(w)


@quantize_columns_transposed.register_fake
def _(w: Tensor) -> tuple[Tensor, Tensor]:
    shape = (w.shape[1], w.shape[0])
    return w.new_empty(shape, dtype=torch.int8), w.new_empty(w.shape[1], dtype=torch.float32)


@torch.library.custom_op("bigclip::switchback_dequantize_rows", mutates_args=())
def dequantize_rows(q: Tensor, absmax: Tensor, dtype: torch.dtype) -> Tensor:
    return backend_for(q).dequantize_rows(q, absmax, dtype)


@dequantize_rows.register_fake
def _(q: Tensor, absmax: Tensor, dtype: torch.dtype) -> Tensor:
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.custom_op("bigclip::switchback_int8_matmul", mutates_args=())
def int8_matmul(
    a: Tensor, b: Tensor, a_absmax: Tensor, b_absmax: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """Dequantised a [M, K] @ b [N, K]^T (+ bias): `a_absmax` [M], `b_absmax` [N] or [] (tensor-wise)."""
    return backend_for(a).int8_matmul(a, b, a_absmax, b_absmax, bias, out_dtype)


@int8_matmul.register_fake
def _(
    a: Tensor, b: Tensor, a_absmax: Tensor, b_absmax: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
