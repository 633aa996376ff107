"""SwitchBack's Triton path as a GPU runs it, on CPU under TRITON_INTERPRET=1, against the
PyTorch path (bit for bit, via tests/support/switchback_selfcheck.py):

- every tile the GPU's autotuner may pick (kernels.GEMM_CONFIGS, forced one at a time with the
  GPU's EVEN_K rule and weight tiles), not only the interpreter's own 32x32x32 tile;
- the layer's calls as models make them, forward and backward: bf16 and fp16 (pure and under
  autocast), 3-D and transposed inputs, transposed / strided / broadcast (stride 0) output
  gradients, with and without bias, M, N, K multiples of no tile, M much larger than N;
- the layer test of tests/test_gpu_ops.py, whose two backends each get a fresh copy of the
  nn.Linear: `from_linear` keeps the Linear's own Parameters, so sharing one between the runs
  adds the first run's weight and bias gradients to the second's (checked here to be caught,
  naming the two gradients).

Like test_switchback_kernels.py, the interpreter must be on before triton is imported, so all
cases run in one fresh Python process and the tests read its report.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from support.switchback_selfcheck import LayerCase, failures  # noqa: E402

from bigclip.ops.int8 import torch_path  # noqa: E402
from bigclip.ops.int8.interpreter_compat import bf16_round_to_nearest_even  # noqa: E402

# The Triton interpreter takes minutes on CPU: make test runs it, test-fast does not.
pytestmark = pytest.mark.slow

# (M, N, K): M far above N, K masked on every tile; and K = 256, where the GPU drops the K masks.
GEMM_SHAPES = [(1100, 48, 208), (300, 200, 256)]
# (M, N, K) of the layer: N, K multiples of 16 (the layer's rule) and of no tile; M = 150 >> N.
_LAYER = {"lead": (3, 50), "in_features": 80, "out_features": 48}
_CALLS = [
    {"param_dtype": torch.bfloat16},  # pure bf16
    {"param_dtype": torch.float32, "autocast": torch.bfloat16, "grad_layout": "strided"},  # amp_bf16
    {
        "param_dtype": torch.float32,
        "autocast": torch.float16,
        "grad_layout": "transposed",
        "permuted_input": True,
    },
    {"param_dtype": torch.float16, "grad_layout": "expanded", "bias": False, "lead": (150,)},
]
LAYER_CASES = [
    LayerCase(quantization, **(_LAYER | call))
    for quantization in ("global", "vectorwise", "memefficient")
    for call in _CALLS
]


def _gemm_report(kernels, selfcheck) -> dict[str, list[dict]]:
    report = {}
    for index, config in enumerate(kernels.GEMM_CONFIGS):
        label = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**config.kwargs)
        with kernels.launch_as_gpu(config):
            rows = [
                r
                for m, n, k in GEMM_SHAPES
                for r in selfcheck.check_gemms(m, n, k, torch.device("cpu"), label=label)
            ]
        report[f"gemm-config-{index}-{label}"] = rows
    return report


def _layer_report(kernels, selfcheck) -> dict[str, list[dict]]:
    """Each call pattern under a different GPU tile (cycling through all of them)."""
    report = {}
    for index, case in enumerate(LAYER_CASES):
        with kernels.launch_as_gpu(kernels.GEMM_CONFIGS[index % len(kernels.GEMM_CONFIGS)]):
            report[f"layer-{case.name}"] = selfcheck.check_layer(case, torch.device("cpu"))
    return report


def _shared_parameters_report(selfcheck) -> dict[str, list[dict]]:
    """The GPU layer test's old pattern, small: both backends run one layer built by from_linear."""
    from bigclip.ops.int8.switchback import LINEAR_CLASSES

    case = LayerCase("global", (2, 64), 128, 256)
    linear, x_leaf, grad = selfcheck.layer_inputs(case, torch.device("cpu"))
    shared = LINEAR_CLASSES["global"].from_linear(linear)
    outputs = {}
    for name in ("triton", "torch"):
        leaf = x_leaf.clone().requires_grad_()
        with selfcheck.backend(name):
            y = shared(leaf)
            y.backward(grad)
        outputs[name] = (y.detach(), leaf.grad, shared.weight.grad.clone(), shared.bias.grad.clone())
    rows = [
        selfcheck.compare(f"shared {key}", got, want)
        for key, got, want in zip(selfcheck.LAYER_OUTPUTS, outputs["triton"], outputs["torch"])
    ]
    return {"shared-parameters": rows, "fresh-copies": selfcheck.check_layer(case, torch.device("cpu"))}


def run_all(out_path: str) -> None:
    """In the subprocess (TRITON_INTERPRET=1): every report, pickled to `out_path`."""
    from support import switchback_selfcheck as selfcheck

    from bigclip.ops.int8 import interpreter_compat, kernels

    assert kernels.interpreting()
    report = _gemm_report(kernels, selfcheck) | _layer_report(kernels, selfcheck)
    report |= _shared_parameters_report(selfcheck)
    report["index-fix-needed-after-install"] = interpreter_compat.needs_fix()
    Path(out_path).write_bytes(pickle.dumps(report))


@pytest.fixture(scope="module")
def report(module_tmp) -> dict:
    out = module_tmp("interpreted") / "report.pkl"
    tests_dir, repo = Path(__file__).parent, Path(__file__).parents[1]
    code = (
        f"import sys; sys.path[:0] = [{str(tests_dir)!r}, {str(repo)!r}]; "
        f"import {Path(__file__).stem} as t; t.run_all({str(out)!r})"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return pickle.loads(out.read_bytes())


@pytest.mark.parametrize("index", range(9))
def test_every_autotune_config_is_bit_identical_to_the_torch_path(report, index):
    """int32 GEMM and the four dequantising epilogues (forward / backward x global / vectorwise)."""
    (rows,) = [v for k, v in report.items() if k.startswith(f"gemm-config-{index}-")]
    assert len(rows) == 5 * len(GEMM_SHAPES) and not failures(rows), failures(rows)


def test_the_configs_tested_are_the_ones_the_gpu_autotunes_over():
    from bigclip.ops.int8 import kernels

    assert len(kernels.GEMM_CONFIGS) == 9
    assert kernels._int8_matmul_tuned.configs == list(kernels.GEMM_CONFIGS)


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.name)
def test_layer_call_pattern_matches_the_torch_path(report, case):
    rows = report[f"layer-{case.name}"]
    assert [r["check"].rsplit(": ", 1)[1] for r in rows] == ["y", "grad_x", "grad_w", "grad_b"]
    assert not failures(rows), failures(rows)


def test_layer_test_with_fresh_copies_passes_and_shared_parameters_are_caught(report):
    assert not failures(report["fresh-copies"]), failures(report["fresh-copies"])
    shared = {r["check"].split()[-1]: r for r in report["shared-parameters"]}
    assert shared["y"]["ok"] and shared["grad_x"]["ok"]  # the kernels agree...
    assert not shared["grad_w"]["ok"] and not shared["grad_b"]["ok"]  # ...the .grad sums do not
    assert shared["grad_w"]["differ"] > 0.5 and "grad_w: " in failures(report["shared-parameters"])


def test_interpreter_index_fix_is_in_place(report):
    assert report["index-fix-needed-after-install"] is False


def test_bf16_rounding_matches_torch():
    """The interpreter's fp32 -> bf16 (bigclip.ops.int8.interpreter_compat) is torch's RNE."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-40, 38, 4096).float()
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895314e38, 1e-45])
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])])
    got = torch.from_numpy(bf16_round_to_nearest_even(x.numpy()).view(np.int16)).view(torch.bfloat16)
    want = x.bfloat16()
    assert torch.equal(got.view(torch.int16)[:-1], want.view(torch.int16)[:-1])
    assert got[-1].isnan()  # NaN's bits differ between torch's own code paths (0x7FC0, 0xFFFF)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_cuda_row_padding_of_the_torch_path_is_exact(rows):
    """torch_path pads GEMMs below CUDA's 17-row minimum; the same code on CPU."""
    g = torch.Generator().manual_seed(rows)
    a = torch.randint(-127, 128, (rows, 48), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (24, 48), dtype=torch.int8, generator=g)
    out = torch_path.int_mm_padded(a, b, min_rows=17)
    assert out.shape == (rows, 24) and torch.equal(out.long(), a.long() @ b.long().t())


def test_launch_as_gpu_forces_one_tile_under_the_gpu_rules():
    from bigclip.ops.int8 import kernels

    config = kernels.GEMM_CONFIGS[4]  # BLOCK_K 64
    with kernels.launch_as_gpu(config):
        launch = kernels._launch()
    assert launch.gemm is config and launch.weight_tile == 64
    assert launch.even_k_blocks == (64, 128)  # masks dropped only where every GPU tile divides K
    assert kernels._launch().gemm is not config
