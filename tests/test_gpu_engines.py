"""Engines on CUDA against the CPU fp32 reference (marker `gpu`: skipped without CUDA, never on CI).

One GPU is enough: each run is a world of one in a fresh process (NCCL on CUDA, gloo on CPU),
the tiny model, 3 steps at lr 1e-4 on the same batches (tests/support/gpu_harness.py).
Tolerances: bf16 autocast changes each loss by well under 2%, so losses agree to 2% relative;
AdamW moves a weight by at most about lr per step whatever its gradient, so after 3 steps any
two runs from the same weights differ by less than 6e-4: weights agree to 1e-3 absolute.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.gpu_harness import run_in_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def cpu_fp32(module_tmp) -> dict:
    return run_in_process({"device": "cpu", "engine": "fsdp"}, module_tmp("cpu"))


def assert_close_runs(got: dict, want: dict) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=2e-2)
    assert got["weights"].keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-3, msg=name)


def test_fsdp2_bf16_on_cuda_matches_cpu_fp32(cpu_fp32, tmp_path):
    spec = {"device": "cuda", "engine": "fsdp", "precision": "amp_bf16", "checkpoint": True}
    got = run_in_process(spec, tmp_path)
    assert_close_runs(got, cpu_fp32)
    # DCP on CUDA: the synchronous and the pinned-memory async save load back bit for bit.
    for which, weights in got["restored"].items():
        for name, value in got["weights"].items():
            assert torch.equal(weights[name], value), f"{which}: {name}"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_zero3_bf16_on_cuda_matches_cpu_fp32(cpu_fp32, tmp_path):
    got = run_in_process({"device": "cuda", "engine": "zero3", "precision": "amp_bf16"}, tmp_path)
    assert_close_runs(got, cpu_fp32)
