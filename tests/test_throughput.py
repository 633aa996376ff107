"""Model TFLOP/s, MFU and the ETA the training log reports (the end-to-end log line and TensorBoard
tags are checked by tests/test_train.py)."""

from __future__ import annotations

import pytest
from support.engine_harness import tiny_config

from bigclip.models.families import model_shape
from bigclip.models.flops import forward_flops
from bigclip.models.shape import ModelOptions
from bigclip.train import throughput


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
     ("NVIDIA A100-SXM4-80GB", 312.0), ("Some Future GPU", None)],
)  # fmt: skip
def test_datasheet_peaks_are_matched_by_device_name(name, peak):
    assert throughput.datasheet_bf16_tflops(name) == peak


def test_flops_per_sample_are_the_planners_count_with_patch_dropout():
    cfg = tiny_config(**{"model.force_patch_dropout": 0.5})
    expected = 3 * forward_flops(model_shape("tiny", ModelOptions(patch_dropout=0.5)))
    assert throughput.train_flops_per_sample(cfg) == expected
    assert expected < 3 * forward_flops(model_shape("tiny"))


def test_mfu_and_eta_from_the_pace():
    # bigG's ~1,065 GFLOPs forward per sample: 100 samples/s over 8 GPUs is 40 TFLOP/s per GPU.
    t = throughput.measure(flops_per_sample=3 * 1.065e12, samples_per_s=100.0, world_size=8,
                           peak_tflops=989.0, steps_left=3600, step_s=2.0)  # fmt: skip
    assert t.tflops_per_gpu == pytest.approx(39.94, rel=1e-3)
    assert t.mfu == pytest.approx(39.94 / 989.0, rel=1e-3)
    assert t.eta_s == 7200
    assert throughput.log_fields(t) == " Model TFLOP/s/gpu: 39.9 MFU: 4.0% ETA: 2h00m"
    cpu = throughput.measure(flops_per_sample=1e9, samples_per_s=10.0, world_size=1, peak_tflops=None,
                             steps_left=-1, step_s=1.0)  # fmt: skip
    assert cpu.mfu is None and cpu.eta_s == 0 and "MFU" not in throughput.log_fields(cpu)
    assert set(throughput.scalars(t)) == {"train/tflops_per_gpu", "train/mfu", "train/eta_hours"}


@pytest.mark.parametrize(
    "seconds, text", [(0, "0s"), (45.4, "45s"), (725, "12m05s"), (11220, "3h07m"), (187200, "2d04h")]
)
def test_eta_reads_at_a_planning_resolution(seconds, text):
    assert throughput.format_eta(seconds) == text
