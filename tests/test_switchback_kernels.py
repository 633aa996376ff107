"""SwitchBack's Triton kernels under TRITON_INTERPRET=1 (CPU) against the PyTorch path: int8
and int32 values bit for bit, dequantised floats too.

The interpreter has to be switched on before triton is first imported (its own standard
library is compiled at import), so every case runs once in a fresh Python process, `CASES`
there computing each case on both backends; the tests here compare what comes back.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Case = Callable[[ModuleType], list[torch.Tensor]]


def _hard_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian rows plus the awkward ones: zeros, tiny values, huge outliers, exact ties, NaN, inf."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    x[1] = 0.0
    x[2] *= 1e-6
    x[3, 5] = 300.0
    x[4, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])
    x[4, 4:] = 0.0
    x[5, 7] = float("nan")
    x[6, 1] = float("-inf")
    return x.to(dtype)


def _int8_pair(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    a[0], b[0] = 127, -127  # extreme sums
    return a, b


def _matmul_case(dtype: torch.dtype, per_row: bool, with_bias: bool) -> Case:
    def run(backend: ModuleType) -> list[torch.Tensor]:
        from bigclip.ops.int8 import torch_path as ref

        g = torch.Generator().manual_seed(1)
        x, w = _hard_rows(40, 64, dtype), torch.randn(48, 64, generator=g).to(dtype)
        bias = torch.randn(48, generator=g).to(dtype) if with_bias else None
        x_q, x_absmax = ref.quantize_rows(x)
        w_q, w_absmax = ref.quantize_rows(w) if per_row else ref.quantize_global(w, transpose=False)
        return [backend.int8_matmul(x_q, w_q, x_absmax, w_absmax, bias, dtype)]

    return run


def _layer_case(quantization: str) -> Case:
    """The whole autograd path (incl. transposed weight quantisation in backward) on one backend."""

    def run(backend: ModuleType) -> list[torch.Tensor]:
        from bigclip.ops.int8 import custom_ops as switchback_ops
        from bigclip.ops.int8.switchback import LINEAR_CLASSES

        os.environ[switchback_ops.BACKEND_ENV] = (
            "torch" if backend.__name__.endswith("torch_path") else "triton"
        )
        assert switchback_ops.backend_for(torch.empty(0)) is backend
        torch.manual_seed(0)
        layer = LINEAR_CLASSES[quantization].from_linear(nn.Linear(64, 96))
        x = torch.randn(2, 20, 64, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        return [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]

    return run


def _dequantize_case(dtype: torch.dtype) -> Case:
    def run(backend: ModuleType) -> list[torch.Tensor]:
        from bigclip.ops.int8 import torch_path as ref

        return [backend.dequantize_rows(*ref.quantize_rows(_hard_rows(19, 80, torch.float32)), dtype)]

    return run


def _cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for name, dtype in DTYPES.items():
        for cols in (48, 80):  # a power of two is not required
            cases[f"rows-{name}-{cols}"] = lambda b, d=dtype, c=cols: list(
                b.quantize_rows(_hard_rows(19, c, d))
            )
        for transpose in (False, True):
            w = torch.randn(40, 72).to(dtype)
            cases[f"global-{name}-{transpose}"] = lambda b, w=w, t=transpose: list(
                b.quantize_global(w, transpose=t)
            )
        cols_input = _hard_rows(40, 72, dtype).t().contiguous()  # non-finite values land in columns
        cases[f"columns-{name}"] = lambda b, w=cols_input: list(b.quantize_columns_transposed(w))
        for per_row in (False, True):
            for bias in (False, True):
                cases[f"matmul-{name}-{per_row}-{bias}"] = _matmul_case(dtype, per_row, bias)
    for m, n, k in [(37, 45, 64), (70, 33, 80), (5, 16, 32)]:
        cases[f"int32-{m}-{n}-{k}"] = lambda b, s=(m, n, k): [b.int8_matmul_int32(*_int8_pair(*s))]
    for name in ("fp32", "fp16"):
        cases[f"dequantize-{name}"] = _dequantize_case(DTYPES[name])
    for quantization in ("global", "vectorwise", "memefficient"):
        cases[f"layer-{quantization}"] = _layer_case(quantization)
    return cases


CASES = _cases()


def run_all_cases(out_path: str) -> None:
    """In the subprocess: each case on the Triton kernels (interpreted) and on the PyTorch path."""
    from bigclip.ops.int8 import kernels as switchback_kernels
    from bigclip.ops.int8 import torch_path as switchback_torch

    assert switchback_kernels.interpreting()
    results = {name: (case(switchback_kernels), case(switchback_torch)) for name, case in CASES.items()}
    Path(out_path).write_bytes(pickle.dumps(results))


@pytest.fixture(scope="module")
def results(module_tmp) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    out = module_tmp("kernels") / "results.pkl"
    tests_dir, repo = Path(__file__).parent, Path(__file__).parents[1]
    code = f"import sys; sys.path[:0] = [{str(tests_dir)!r}, {str(repo)!r}]; import {Path(__file__).stem} as t; t.run_all_cases({str(out)!r})"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return pickle.loads(out.read_bytes())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN included."""
    same_bits = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a.dtype == b.dtype and a.shape == b.shape and same_bits


def _names(prefix: str) -> list[str]:
    return [name for name in CASES if name.startswith(prefix)]


@pytest.mark.parametrize("case", _names("rows-"))
def test_quantize_rows_bit_identical(results, case):
    (q, absmax), expected = results[case]
    assert _same(q, expected[0]) and _same(absmax, expected[1])
    assert q[4, :4].tolist() == [127, 0, 2, -2]  # half to even
    assert absmax[5:7].isnan().all() and not q[5:7].any()  # non-finite rows marked, not quantised


@pytest.mark.parametrize("case", _names("global-") + _names("columns-"))
def test_quantize_weight_bit_identical(results, case):
    (q, absmax), expected = results[case]
    assert _same(q, expected[0]) and _same(absmax, expected[1])
    assert q.is_contiguous()


@pytest.mark.parametrize("case", _names("int32-"))
def test_int8_matmul_int32_bit_identical(results, case):
    (acc,), (expected,) = results[case]
    assert _same(acc, expected)
    m, n, k = map(int, case.split("-")[1:])
    a, b = _int8_pair(m, n, k)
    assert torch.equal(acc.long(), a.long() @ b.long().t())


@pytest.mark.parametrize("case", _names("matmul-"))
def test_int8_matmul_dequantized_output(results, case):
    (out,), (expected,) = results[case]
    assert out[5:7].isnan().all()  # rows with NaN/inf input
    # bf16 too: bigclip.ops.int8.interpreter_compat makes the interpreter round to nearest even.
    # (NaN's bits are not compared: torch's own bf16 conversions disagree on them.)
    assert torch.equal(out.isnan(), expected.isnan())
    assert _same(out.nan_to_num(0.0), expected.nan_to_num(0.0))


@pytest.mark.parametrize("case", _names("dequantize-"))
def test_dequantize_rows_bit_identical(results, case):
    (out,), (expected,) = results[case]
    assert _same(out, expected)


@pytest.mark.parametrize("case", _names("layer-"))
def test_layer_on_triton_backend_equals_torch_backend(results, case):
    got, expected = results[case]
    assert len(got) == 4 and all(_same(a, b) for a, b in zip(got, expected))


# Kernel signatures as the JIT sees them at launch: 16-byte aligned pointers, and sizes and
# strides divisible by 16 (what SwitchBack's shape rule guarantees), so loads vectorise.
_GEMM_SIGNATURE = {
    **dict.fromkeys(["a_ptr", "b_ptr"], "*i8"),
    **dict.fromkeys(["out_ptr", "bias_ptr"], "*bf16"),
    **dict.fromkeys(["a_absmax_ptr", "b_absmax_ptr"], "*fp32"),
    **dict.fromkeys(["M", "N", "K", "stride_am", "stride_bn", "stride_om"], "i32"),
}
_ROWS_SIGNATURE = {
    "x_ptr": "*bf16",
    "q_ptr": "*i8",
    "absmax_ptr": "*fp32",
    "n_cols": "i32",
    "stride_x": "i32",
}
_TILES_SIGNATURE = {"w_ptr": "*bf16", "q_ptr": "*i8", "absmax_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32"}


def _compile(fn, signature: dict, constexprs: dict, arch: int, **options):
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in signature}
    signature = signature | dict.fromkeys(constexprs, "constexpr")
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton_compile(
        source, target=GPUTarget("cuda", arch, 32), options=options | {"enable_fp_fusion": False}
    )


def _jit_kernels():
    """A private copy of the kernels module, decorated now: Triton picks the interpreter when a kernel
    is decorated, so the copy in sys.modules holds interpreted kernels if an earlier test of this
    process imported it under TRITON_INTERPRET=1."""
    name = "bigclip_kernels_jit_copy"  # its own name: dataclasses look their module up in sys.modules
    if name not in sys.modules:
        origin = importlib.util.find_spec("bigclip.ops.int8.kernels").origin
        spec = importlib.util.spec_from_file_location(name, origin)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_nvidia_gpus(arch):
    """Compiled for A100 (sm_80) and H100/H200 (sm_90) with Triton's bundled ptxas, no GPU needed:
    the GEMM must use int8 tensor-core instructions and a multi-stage pipeline of async copies."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("kernels are interpreted in this process")
    kernels = _jit_kernels()
    _compile(kernels._quantize_rows_kernel, _ROWS_SIGNATURE, {"BLOCK": 8192}, arch, num_warps=8)
    for per_column, transpose in [(False, False), (False, True), (True, True)]:
        flags = {"PER_COLUMN": per_column, "TRANSPOSE": transpose, "BLOCK_R": 64, "BLOCK_C": 64}
        _compile(kernels._quantize_tiles_kernel, _TILES_SIGNATURE, flags, arch)
    config = kernels.GEMM_CONFIGS[0]
    flags = {"DEQUANTIZE": True, "B_PER_ROW": False, "HAS_BIAS": True, "EVEN_K": True, **config.kwargs}
    gemm = _compile(
        kernels._int8_matmul_kernel, _GEMM_SIGNATURE, flags, arch,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    tensor_core = "wgmma.mma_async" if arch == 90 else "mma.sync"
    assert re.search(rf"{tensor_core}[\w.]*\.s32\.s8\.s8", gemm.asm["ptx"])
    # The K loop is software-pipelined: >= 2 shared-memory stages filled by async copies
    # (Triton trims the 3 asked for to what the GPU's shared memory holds).
    stages = [int(n) for n in re.findall(r"memdesc<(\d+)x\d+x\d+xi8", gemm.asm["ttgir"])]
    assert stages and min(stages) >= 2
    assert "async_copy_global_to_local" in gemm.asm["ttgir"]
