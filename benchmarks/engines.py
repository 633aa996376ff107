"""Sharding engines side by side: per-rank model-state memory and step time, FSDP2 vs ZeRO-1/2/3.

CPU (always): ViT-B-32, fp32 and amp_bf16, 2 ranks over gloo, a fresh pair of processes per
engine, all in one run. "Model state" is every live tensor storage on the rank right after backward (parameters,
gradients, optimizer state, the engines' own buffers; activations are freed by then), counted
once per storage; "optimizer state" is what the optimizer itself holds. Rows with --optimizer
adamw8bit show the optimizer state bitsandbytes saves.

GPU (when CUDA is present): ViT-bigG-14 on one GPU, amp_bf16, grad checkpointing, compiled
blocks, FSDP2 vs ZeRO-3: the largest batch that fits (doubling, then bisection; one fresh
process per trial), samples/s and MFU.

MFU = model FLOPs per second / the device's peak dense bf16 FLOPs. Model FLOPs per sample =
3 x forward (backward = 2 x forward), the forward counted from the model config: every matmul
(2 FLOPs per multiply-add) in the patch embedding, attention projections, attention scores and
values, MLPs and output projections; 1,065 GFLOPs for ViT-bigG-14 at 224 px. Recomputation under
grad checkpointing is hardware work, not model work, and is not counted.

    python benchmarks/engines.py                 # CPU rows (+ GPU rows when CUDA is present)
    python benchmarks/engines.py --no-gpu --steps 4 --batch 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import print_table, write_results  # noqa: E402

from bigclip.config import TrainConfig  # noqa: E402
from bigclip.distributed import Runtime, free_port, init_distributed, spawn  # noqa: E402
from bigclip.engines import Engine, build_engine  # noqa: E402
from bigclip.engines.optim import LocalShardOptimizer, local_tensor  # noqa: E402
from bigclip.models import count_parameters, create_model, get_model_config  # noqa: E402
from bigclip.models.flops import forward_flops  # noqa: E402
from bigclip.models.from_config import build_model, synthetic_batch  # noqa: E402
from bigclip.ops.loss.contrastive import build_loss  # noqa: E402
from bigclip.train.step import contrastive_loss  # noqa: E402

_ZERO = [("deepspeed", "zero1"), ("deepspeed", "zero2"), ("deepspeed", "zero3")]
CPU_RUNS = [  # (engine, ds_config, optimizer, precision); the first row of each precision is the baseline
    *[(e, c, "adamw", p) for p in ("fp32", "amp_bf16") for e, c in [("fsdp", ""), *_ZERO]],
    ("fsdp", "", "adamw8bit", "fp32"),
    ("deepspeed", "zero2", "adamw8bit", "fp32"),
]
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, SXM parts


def run_config(engine: str, ds_config: str, **flags: object) -> TrainConfig:
    cfg = TrainConfig()
    cfg.engine.engine = engine
    cfg.engine.deepspeed_config = str(ROOT / "ds_configs" / f"{ds_config}.json") if ds_config else ""
    cfg.optim.lr, cfg.optim.warmup = 1e-4, 0
    cfg.loss.local_loss = cfg.loss.gather_with_grad = True
    for key, value in flags.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg.validate()


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python on this process."""
    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes
        warnings.simplefilter("ignore", FutureWarning)
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # wrapper tensors (DTensor) own no storage; their local tensors are counted
        if pointer and pointer not in seen:
            seen.add(pointer)
            total += storage.nbytes()
    return total


def optimizer_state_bytes(engine: Engine) -> int:
    optimizer = getattr(engine, "ds_engine", None)
    optimizer = optimizer.optimizer.optimizer if optimizer is not None else engine.optimizer
    if isinstance(optimizer, LocalShardOptimizer):
        optimizer = optimizer.inner
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                storage = local_tensor(value).untyped_storage()
                if storage.data_ptr() not in seen:  # 8-bit code books are shared
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def timed_steps(engine: Engine, cfg: TrainConfig, steps: int) -> tuple[list[float], int]:
    """Step times (forward, backward, optimizer) and the live bytes after the last backward."""
    loss_fn, device = build_loss(cfg.loss), engine.runtime.device
    images, texts = synthetic_batch(cfg, device=device)
    times, after_backward = [], 0
    for step in range(steps + 1):
        _sync(device)
        start = time.perf_counter()
        engine.backward(contrastive_loss(loss_fn, engine.forward(images, texts)))
        if step == steps:  # an extra, untimed step: optimizer state exists by now
            after_backward = live_tensor_bytes()
        engine.step(lr=cfg.optim.lr)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times[1:steps], after_backward  # the first step creates the optimizer state


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def cpu_worker(rank: int, world: int, run: tuple[str, str, str, str], batch: int, steps: int) -> dict:
    engine_name, ds_config, optimizer, precision = run
    cfg = run_config(
        engine_name,
        ds_config,
        **{"model.model": "ViT-B-32", "engine.precision": precision, "data.batch_size": batch},
        **{"optim.optimizer": optimizer},
    )
    runtime = Runtime(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    engine = build_engine(cfg, runtime)
    engine.build(build_model(cfg))
    times, state_bytes = timed_steps(engine, cfg, steps)
    return {"step_s": statistics.median(times), "state": state_bytes, "optim": optimizer_state_bytes(engine)}


def cpu_rows(*, batch: int, steps: int, world: int = 2) -> list[dict]:
    params = count_parameters(create_model("ViT-B-32", device="meta"))["total"]
    rows = []
    for run in CPU_RUNS:
        ranks = spawn(cpu_worker, world, run, batch, steps)
        rows.append(
            {
                "engine": run[1] or run[0],
                "optimizer": run[2],
                "precision": run[3],
                "params_M": params / 1e6,
                "model_state_MB_per_rank": max(r["state"] for r in ranks) / 2**20,
                "optimizer_state_MB_per_rank": max(r["optim"] for r in ranks) / 2**20,
                "step_s": max(r["step_s"] for r in ranks),
                "samples_per_s": batch * world / max(r["step_s"] for r in ranks),
            }
        )
    for row in rows:
        base = next(r for r in rows if r["precision"] == row["precision"])
        row["memory_vs_fsdp"] = row["model_state_MB_per_rank"] / base["model_state_MB_per_rank"]
        row["time_vs_fsdp"] = row["step_s"] / base["step_s"]
        same = next(r for r in rows if r["engine"] == row["engine"] and r["precision"] == row["precision"])
        row["optim_state_vs_adamw"] = row["optimizer_state_MB_per_rank"] / same["optimizer_state_MB_per_rank"]
    return rows


def gpu_trial(engine_name: str, batch: int, steps: int) -> dict:
    """One fresh process: ViT-bigG-14 on cuda:0 at `batch`; {"oom": True} if it does not fit."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    flags = {
        "model.model": "ViT-bigG-14",
        "model.grad_checkpointing": True,
        "model.torchcompile": True,
        "engine.precision": "amp_bf16",
        "data.batch_size": batch,
    }
    if engine_name == "zero3":
        cfg = run_config("deepspeed", "zero3", **flags)
    else:
        cfg = run_config("fsdp", "", **flags)
    try:
        runtime = init_distributed()
        engine = build_engine(cfg, runtime)
        engine.build(build_model(cfg))
        times, _ = timed_steps(engine, cfg, steps)
    except torch.OutOfMemoryError:
        return {"oom": True}
    step_s = statistics.median(times)
    peak = _peak_bf16_flops(torch.cuda.get_device_name())
    flops = 3 * forward_flops(get_model_config("ViT-bigG-14")) * batch / step_s
    return {
        "oom": False,
        "step_s": step_s,
        "samples_per_s": batch / step_s,
        "mfu": flops / peak if peak else None,
        "peak_memory_GB": torch.cuda.max_memory_allocated() / 2**30,
    }


def _peak_bf16_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def _run_trial(engine_name: str, batch: int, steps: int) -> dict:
    command = [sys.executable, __file__, "--gpu-trial", engine_name, str(batch), str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"oom": True, "error": done.stderr[-2000:]}


def gpu_rows(*, steps: int) -> list[dict]:
    rows = []
    for engine_name in ("fsdp", "zero3"):
        best, fits, batch = None, 0, 8
        while (trial := _run_trial(engine_name, batch, steps)) and not trial["oom"]:
            best, fits, batch = trial, batch, batch * 2
        low, high = fits, batch  # bisect between the last fit and the first failure, in steps of 8
        while high - low > 8:
            middle = (low + high) // 16 * 8
            trial = _run_trial(engine_name, middle, steps)
            low, high, best = (middle, high, trial) if not trial["oom"] else (low, middle, best)
        row = {"engine": engine_name, "model": "ViT-bigG-14", "batch": low}
        rows.append({**row, **best} if best else {**row, "error": trial.get("error", "batch 8 does not fit")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch for the CPU rows")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per engine")
    parser.add_argument("--no-gpu", action="store_true")
    parser.add_argument("--gpu-trial", nargs=3, metavar=("ENGINE", "BATCH", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpu_trial:
        engine_name, batch, steps = args.gpu_trial
        print(json.dumps(gpu_trial(engine_name, int(batch), int(steps))))
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the CPU rows run DeepSpeed on its CPU accelerator
    rows = cpu_rows(batch=args.batch, steps=args.steps)
    print_table(rows)
    extra = {"cpu_setup": f"ViT-B-32, 2 ranks x batch {args.batch}, gloo, {args.steps} timed steps"}
    if torch.cuda.is_available() and not args.no_gpu:
        gpu = gpu_rows(steps=args.steps)
        print_table(gpu)
        extra["gpu_rows"] = gpu
        extra["gpu_setup"] = "ViT-bigG-14, amp_bf16, grad checkpointing, compiled blocks, 1 GPU"
    write_results("engines", rows, **extra)


if __name__ == "__main__":
    main()
