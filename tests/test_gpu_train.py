"""`python -m bigclip.train` on one GPU, as a user first runs it (marker `gpu`: skipped without
CUDA, never on CI): demo shards through the loader's pinned uint8 batches, FSDP2 with amp_bf16,
grad checkpointing and the chunked loss, an async save, then `--resume latest` continuing at
the saved step. The engine-level numerics are tests/test_gpu_engines.py's; this is the path in
between (device placement, NCCL world of one, GPU normalisation, peak-memory logging, staging a
checkpoint from CUDA memory).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.train_harness import demo_argv
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[1]
GPU_FLAGS = ("--precision", "amp_bf16", "--grad-checkpointing", "--loss-chunk-size", "16", "--async-save",
             "--save-every-n-steps", "10", "--workers", "2")  # fmt: skip


def train(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "bigclip.train", *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def scalars(run_dir: Path, tag: str) -> list[float]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def test_train_save_and_resume_on_one_gpu(demo_data, tmp_path):
    first = demo_argv(demo_data, tmp_path, *GPU_FLAGS, "--max-steps", "20", name="gpu")  # later flags win
    train(first)
    run_dir = tmp_path / "gpu"
    assert "rank 0 on cuda:0" in (run_dir / "out.log").read_text()
    assert (run_dir / "checkpoints" / "step_00000020" / "manifest.json").exists()
    assert all(math.isfinite(v) for v in scalars(run_dir, "train/loss"))
    assert min(scalars(run_dir, "train/peak_memory_gb")) > 0
    eval_metrics = json.loads((run_dir / "results.jsonl").read_text().splitlines()[-1])
    assert eval_metrics["image_to_text_R@1"] > eval_metrics["chance"]

    train([*first, "--max-steps", "30", "--resume", "latest"])
    log = (run_dir / "out.log").read_text()
    assert "at step 20" in log and (run_dir / "checkpoints" / "step_00000030" / "manifest.json").exists()


def test_fp8_kind_trains_compiled_like_bf16_or_is_refused(demo_data, tmp_path):
    """--linear-kind fp8-tensorwise with --torchcompile on one GPU: on an fp8 GPU (compute
    capability 8.9+) 30 steps train to within 10% of the bf16 run's final loss and MFU is logged;
    on an older GPU the run is refused in one line before anything is built."""
    pytest.importorskip("torchao", reason="the fp8 kinds need torchao (make gpu-wheels carries it)")
    flags = ("--torchcompile", "--max-steps", "30", "--save-every-n-steps", "0")
    if torch.cuda.get_device_capability() < (8, 9):
        argv = demo_argv(
            demo_data, tmp_path, *GPU_FLAGS, *flags, "--linear-kind", "fp8-tensorwise", name="fp8"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "bigclip.train", *argv], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=400)  # fmt: skip
        assert done.returncode == 2 and "compute capability 8.9" in done.stderr, done.stderr[-2000:]
        return
    for name, kind in (("bf16", "none"), ("fp8", "fp8-tensorwise")):  # every linear: the kind's numerics
        kind_flags = ("--linear-kind", kind, "--linear-filter", "all")
        train(demo_argv(demo_data, tmp_path, *GPU_FLAGS, *flags, *kind_flags, name=name))
    bf16, fp8 = scalars(tmp_path / "bf16", "train/loss"), scalars(tmp_path / "fp8", "train/loss")
    assert all(math.isfinite(v) for v in fp8) and fp8[-1] == pytest.approx(bf16[-1], rel=0.1)
    from bigclip.train.throughput import datasheet_bf16_tflops

    if datasheet_bf16_tflops(torch.cuda.get_device_name()) is not None:  # MFU only where a peak is known
        assert min(scalars(tmp_path / "fp8", "train/mfu")) > 0
