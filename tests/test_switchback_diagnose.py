"""The GPU diagnostic `python benchmarks/switchback.py --diagnose` (switchback_diagnose.py), run
as a user runs it but on CPU under TRITON_INTERPRET=1 with its small sizes, so it cannot rot
before the next GPU: every kernel, every GPU tile and the layer's four outputs per
quantisation are in its report, and on this (correct) code all of them agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The Triton interpreter takes minutes on CPU: make test runs it, test-fast does not.
pytestmark = pytest.mark.slow

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def diagnosis(module_tmp) -> tuple[subprocess.CompletedProcess, dict]:
    out = module_tmp("diagnose") / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "benchmarks/switchback.py", "--diagnose", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_every_check_agrees_and_the_table_says_so(diagnosis):
    done, report = diagnosis
    rows = report["rows"]
    assert report["ok"] and report["interpreted"] and not report["failures"]
    assert f"all {len(rows)} checks agree" in done.stdout
    assert all(r["ok"] and r["max_ulps"] == 0 for r in rows)


def test_the_report_covers_every_kernel_tile_and_layer_output(diagnosis):
    from bigclip.ops.int8.kernels import GEMM_CONFIGS

    checks = [r["check"] for r in diagnosis[1]["rows"]]
    for kernel in ("quantize_rows(x)", "quantize_rows(w)", "quantize_global(w)", "quantize_rows(grad)",
                   "quantize_columns_transposed(w)", "quantize_global(w, transpose)", "dequantize_rows"):  # fmt: skip
        assert any(kernel in c for c in checks), kernel
    for config in GEMM_CONFIGS:
        tile = "[{BLOCK_M}x{BLOCK_N}x{BLOCK_K}] s{s} w{w}".format(
            **config.kwargs, s=config.num_stages, w=config.num_warps
        )
        gemms = [c for c in checks if c.startswith("gemm") and c.endswith(tile)]
        assert len(gemms) == 5, tile  # int32, fwd y and bwd grad_x, each global and vectorwise
    for quantization in ("global", "vectorwise", "memefficient"):
        for output in ("y", "grad_x", "grad_w", "grad_b"):
            layer = [
                c for c in checks if c.startswith(f"layer {quantization}-") and c.endswith(f": {output}")
            ]
            assert len(layer) == 2, (quantization, output)  # pure bf16 and amp_bf16
