"""Model FLOP throughput, MFU and the run's ETA, for the training log and TensorBoard.

FLOPs per sample are `models/flops.py`'s count, the one the planner and the GPU benchmarks use:
3x the forward (backward is twice the forward), with patch dropout's shorter image sequence.
Recomputation by activation checkpointing is hardware work, not model work, and is not counted
(MFU as PaLM defines it, appendix B). MFU divides by the device's dense bf16 tensor-core peak
from its datasheet (the table below); fp8 linear kinds are measured against the same bf16 peak,
as torchtitan reports them, so their gain shows as a higher MFU. A device not in the table (a CPU,
an unlisted GPU) gets TFLOP/s but no MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bigclip.config import TrainConfig

# Dense bf16 tensor-core peak, TFLOP/s, from NVIDIA's datasheets, matched against the device name
# in order: the first key the name contains wins (PCIe and NVL parts clock lower than SXM ones).
DATASHEET_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5: "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # also GH200's GPU
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)


def datasheet_bf16_tflops(device_name: str) -> float | None:
    return next((peak for key, peak in DATASHEET_BF16_TFLOPS if key in device_name), None)


def device_peak_tflops(device: torch.device) -> float | None:
    """The datasheet bf16 peak of the GPU `device` is, or None (a CPU, a GPU not in the table)."""
    if device.type != "cuda":
        return None
    return datasheet_bf16_tflops(torch.cuda.get_device_name(device))


def train_flops_per_sample(cfg: TrainConfig) -> float:
    from bigclip.models.families import model_shape
    from bigclip.models.flops import forward_flops
    from bigclip.models.run_options import model_options

    return 3 * forward_flops(model_shape(cfg.model.model, model_options(cfg)))


@dataclass(frozen=True)
class Throughput:
    tflops_per_gpu: float  # model FLOPs per second and GPU (rank), in TFLOP/s
    mfu: float | None  # of the datasheet bf16 peak; None where the device has none
    eta_s: float  # seconds until the run's last step at the current pace


def measure(
    *, flops_per_sample: float, samples_per_s: float, world_size: int, peak_tflops: float | None,
    steps_left: int, step_s: float,
) -> Throughput:  # fmt: skip
    tflops = flops_per_sample * samples_per_s / world_size / 1e12
    return Throughput(tflops, tflops / peak_tflops if peak_tflops else None, max(steps_left, 0) * step_s)


def format_eta(seconds: float) -> str:
    """A duration at the resolution a person plans by: 45s, 12m05s, 3h07m, 2d04h."""
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def log_fields(t: Throughput) -> str:
    """Appended to OpenCLIP's log line: model TFLOP/s per GPU, MFU where known, the ETA."""
    mfu = f" MFU: {t.mfu:.1%}" if t.mfu is not None else ""
    return f" Model TFLOP/s/gpu: {t.tflops_per_gpu:#.3g}{mfu} ETA: {format_eta(t.eta_s)}"


def scalars(t: Throughput) -> dict[str, float]:
    values = {"train/tflops_per_gpu": t.tflops_per_gpu, "train/eta_hours": t.eta_s / 3600}
    return values | ({"train/mfu": t.mfu} if t.mfu is not None else {})
