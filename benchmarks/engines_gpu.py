"""ViT-bigG-14 training step on one GPU at the largest batch that fits: samples/s, peak memory, MFU.

    python benchmarks/engines_gpu.py --engine fsdp [--quick]     # FSDP2 (torch only)
    python benchmarks/engines_gpu.py --engine zero3 [--quick]    # DeepSpeed ZeRO-3 (skipped without it)

amp_bf16, grad checkpointing, compiled blocks, the chunked loss, torch AdamW, a world of one on
cuda:0. The batch is found in this one process, not a process per trial: the peak memory of an
uncompiled step at batches 8 and 16 gives memory per sample and the fixed part (model state);
the largest multiple of 8 predicted to leave 3% free is tried, and on OOM (only
torch.OutOfMemoryError counts as one; any other error fails the row) the engine is rebuilt and
8 fewer tried. The chosen batch is then timed compiled. MFU = 3 x forward FLOPs x batch / step
time (bigclip/models/flops.py; checkpointing's recomputation is hardware work, not counted) over
the measured 8192^3 bf16 matmul peak and over the datasheet peak: both printed.
Writes results/engines_<engine>_gpu.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import gpu_info, mfu, missing_package, print_table, write_gpu_results  # noqa: E402

from bigclip.config import TrainConfig  # noqa: E402
from bigclip.distributed import free_port, init_distributed  # noqa: E402
from bigclip.engines import Engine, build_engine  # noqa: E402
from bigclip.models.families import model_shape  # noqa: E402
from bigclip.models.flops import forward_flops  # noqa: E402
from bigclip.models.from_config import build_model, model_factory, synthetic_batch  # noqa: E402
from bigclip.ops.loss.contrastive import build_loss  # noqa: E402
from bigclip.train.trainer import train_step  # noqa: E402

MODEL = "ViT-bigG-14"
HEADROOM = 0.97  # of total GPU memory: the allocator's fragmentation and cuBLAS workspaces


def config(engine: str, *, compiled: bool, model: str = MODEL) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.model, cfg.model.grad_checkpointing, cfg.model.torchcompile = model, True, compiled
    cfg.engine.precision = "amp_bf16"
    if engine == "zero3":
        cfg.engine.engine = "deepspeed"
        cfg.engine.deepspeed_config = str(ROOT / "ds_configs" / "zero3_vit_bigg.json")
    cfg.optim.lr, cfg.optim.warmup = 1e-4, 0
    cfg.loss.local_loss = cfg.loss.gather_with_grad = True
    cfg.loss.loss_chunk_size = 1024
    cfg.data.batch_size = 8
    return cfg.validate()


def build(cfg: TrainConfig) -> Engine:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    engine = build_engine(cfg, init_distributed())
    engine.build(build_model(cfg), rebuild=model_factory(cfg))
    return engine


def release(engine: Engine | None) -> None:
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def step_times(engine: Engine, cfg: TrainConfig, batch: int, steps: int) -> tuple[list[float], int]:
    """Seconds of each step after one warm-up (compilation, optimizer state), and the peak bytes."""
    loss_fn = build_loss(cfg.loss)
    micro = [synthetic_batch(cfg, device="cuda", batch_size=batch)]
    train_step(engine, loss_fn, micro, lr=cfg.optim.lr)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(engine, loss_fn, micro, lr=cfg.optim.lr)
        torch.cuda.synchronize()  # the step's kernels are queued: time them, not their launch
        times.append(time.perf_counter() - start)
    return times, torch.cuda.max_memory_allocated()


def predicted_batch(engine: Engine, cfg: TrainConfig) -> tuple[int, dict]:
    _, at8 = step_times(engine, cfg, 8, 1)
    _, at16 = step_times(engine, cfg, 16, 1)
    per_sample = (at16 - at8) / 8
    usable = HEADROOM * torch.cuda.get_device_properties(0).total_memory
    batch = max(8, int((usable - (at8 - 8 * per_sample)) / per_sample) // 8 * 8)
    return batch, {"peak_GiB_b8": at8 / 2**30, "GiB_per_sample": per_sample / 2**30}


def largest_batch(engine_name: str) -> tuple[int, dict]:
    """The largest batch (multiple of 8) that runs uncompiled, and how it was found."""
    cfg = config(engine_name, compiled=False)
    engine = build(cfg)
    batch, found = predicted_batch(engine, cfg)
    found["predicted_batch"] = batch
    while batch > 8:
        try:
            step_times(engine, cfg, batch, 1)
            break
        except torch.OutOfMemoryError:
            release(engine)
            engine, batch = build(cfg), batch - 8
    release(engine)
    return batch, found


def measure(engine_name: str, *, steps: int, batch: int = 0) -> dict:
    info = gpu_info()
    found: dict = {}
    if not batch:
        batch, found = largest_batch(engine_name)
    cfg = config(engine_name, compiled=True)
    engine = build(cfg)
    try:
        times, peak = step_times(engine, cfg, batch, steps)
    except torch.OutOfMemoryError:  # compiled kernels need a little more: one step back
        release(engine)
        batch, engine = batch - 8, build(cfg)
        times, peak = step_times(engine, cfg, batch, steps)
    step_s = statistics.median(times)
    flops_per_s = 3 * forward_flops(model_shape(MODEL)) * batch / step_s
    row = {"engine": engine_name, "model": MODEL, "batch": batch, "step_s": step_s}
    row |= {"samples_per_s": batch / step_s, "peak_memory_GiB": peak / 2**30, **mfu(flops_per_s, info)}
    return {**row, **found, "model_TFLOPs_per_s": flops_per_s / 1e12}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("fsdp", "zero3"), default="fsdp")
    parser.add_argument("--quick", action="store_true", help="3 timed steps instead of 8")
    parser.add_argument("--batch", type=int, default=0, help="skip the search: time this batch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: needs a CUDA GPU")
        return 0
    if args.engine == "zero3" and (reason := missing_package("deepspeed")):
        print(f"SKIP: {reason}")
        return 0
    row = measure(args.engine, steps=3 if args.quick else 8, batch=args.batch)
    print_table([row])
    setup = "amp_bf16, grad checkpointing, compiled blocks, chunked loss (1024), torch AdamW, 1 GPU"
    write_gpu_results(f"engines_{args.engine}", [row], setup=setup, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
