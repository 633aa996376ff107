"""Shared reporting for benchmarks: a printed table and benchmarks/results/NAME.json."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bigclip.train.throughput import datasheet_bf16_tflops

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def env_with_checkout() -> dict[str, str]:
    """The environment for a child Python: this checkout first on PYTHONPATH, whatever the caller's
    path held after it (a GPU node's carried wheels unpacked into a folder)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(RESULTS_DIR.parents[1]), os.environ.get("PYTHONPATH", "")]),
    }


def git_commit() -> str:
    """This tree's commit, or BIGCLIP_COMMIT where set: a GPU node's copy of the tree may carry a
    .git that is not the one the tree was copied from."""
    if os.environ.get("BIGCLIP_COMMIT"):
        return os.environ["BIGCLIP_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=RESULTS_DIR.parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def openclip_train_step(
    model: Any, loss_fn: Any, optimizer: Any, images: Any, texts: Any
) -> Callable[[], None]:
    """OpenCLIP's training step as its trainer takes it: bf16 autocast over the forward and loss,
    backward, optimizer step."""

    def step() -> None:
        with torch.autocast(images.device.type, dtype=torch.bfloat16):
            image, text, scale = model(images, texts)
            loss = loss_fn(image, text, scale)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def device_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def print_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    if not rows:
        return
    columns = columns or list(rows[0])
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_results(name: str, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """Write rows plus provenance (date, commit, device, torch version) to results/NAME.json."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": device_description(),
        "torch": torch.__version__,
        **extra,
        "rows": rows,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


# -- GPU rows ---------------------------------------------------------------------------------

# The datasheet peaks are the training log's (bigclip/train/throughput.py): one table.
PEAK_ENV = "BIGCLIP_BF16_PEAK_TFLOPS"  # set by gpu_suite.py so each row does not re-measure


def measured_bf16_tflops(n: int = 8192, reps: int = 20) -> float:
    """The best sustained rate of an n^3 bf16 matmul on this GPU, TFLOP/s (cuBLAS, fp32 accumulate)."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV])
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):  # warm-up: clocks ramp, cuBLAS picks its kernel
        torch.mm(a, b, out=out)
    best = math.inf
    for _ in range(3):  # best of 3 batches of `reps`: a shared or throttling GPU only slows some
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return 2 * n**3 / best / 1e12


def gpu_info() -> dict[str, Any]:
    """Device, versions and both bf16 peaks, for every *_gpu.json."""
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": props.name,
        "gpu_memory_GiB": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "bf16_peak_measured_TFLOPs": round(measured_bf16_tflops(), 1),
        "bf16_peak_datasheet_TFLOPs": datasheet_bf16_tflops(props.name),
        "peak_measurement": "8192^3 bf16 torch.mm, best of 3 x 20, CUDA events",
    }


def mfu(model_flops_per_s: float, info: dict[str, Any]) -> dict[str, float | None]:
    """Model FLOPs utilisation over the measured and the datasheet bf16 peak."""
    measured, sheet = info["bf16_peak_measured_TFLOPs"], info["bf16_peak_datasheet_TFLOPs"]
    return {
        "mfu_vs_measured_peak": model_flops_per_s / (measured * 1e12),
        "mfu_vs_datasheet_peak": model_flops_per_s / (sheet * 1e12) if sheet else None,
    }


def write_gpu_results(name: str, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """results/NAME_gpu.json with the GPU's description and peaks."""
    return write_results(f"{name}_gpu", rows, **gpu_info(), **extra)


def missing_package(*modules: str) -> str | None:
    """'needs X (not installed)' for the first module that cannot be found, else None."""
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"needs {module} (not installed)"
    return None
