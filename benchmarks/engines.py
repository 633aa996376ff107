"""Sharding engines side by side: per-rank model-state memory and step time, FSDP2 vs ZeRO-1/2/3.

CPU (always): ViT-B-32, fp32 and amp_bf16, 2 ranks over gloo, a fresh pair of processes per
engine, all in one run. "Model state" is every live tensor storage on the rank right after backward (parameters,
gradients, optimizer state, the engines' own buffers; activations are freed by then), counted
once per storage; "optimizer state" is what the optimizer itself holds. Rows with --optimizer
adamw8bit show the optimizer state bitsandbytes saves.

Rows whose package is missing (DeepSpeed, bitsandbytes) are skipped with the reason. The GPU
rows (ViT-bigG-14 at the largest batch that fits, MFU) are benchmarks/engines_gpu.py.

    python benchmarks/engines.py [--steps 4 --batch 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import missing_package, print_table, write_results  # noqa: E402

from bigclip.config import TrainConfig  # noqa: E402
from bigclip.distributed import Runtime, spawn  # noqa: E402
from bigclip.engines import Engine, build_engine  # noqa: E402
from bigclip.engines.optimizer import LocalShardOptimizer, local_tensor  # noqa: E402
from bigclip.models.factory import count_parameters, create_model  # noqa: E402
from bigclip.models.from_config import build_model, model_factory, synthetic_batch  # noqa: E402
from bigclip.ops.loss.contrastive import build_loss  # noqa: E402
from bigclip.train.trainer import contrastive_loss  # noqa: E402

_ZERO = [("deepspeed", "zero1"), ("deepspeed", "zero2"), ("deepspeed", "zero3")]
CPU_RUNS = [  # (engine, ds_config, optimizer, precision); the first row of each precision is the baseline
    *[(e, c, "adamw", p) for p in ("fp32", "amp_bf16") for e, c in [("fsdp", ""), *_ZERO]],
    ("fsdp", "", "adamw8bit", "fp32"),
    ("deepspeed", "zero2", "adamw8bit", "fp32"),
]


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
    engine.build(build_model(cfg), rebuild=model_factory(cfg))
    times, state_bytes = timed_steps(engine, cfg, steps)
    return {"step_s": statistics.median(times), "state": state_bytes, "optim": optimizer_state_bytes(engine)}


def cpu_rows(runs: list[tuple], *, batch: int, steps: int, world: int = 2) -> list[dict]:
    params = count_parameters(create_model("ViT-B-32", device="meta"))["total"]
    rows = []
    for run in runs:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per engine")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the CPU rows run DeepSpeed on its CPU accelerator
    runs, skipped = runnable(CPU_RUNS)
    for run, reason in skipped:
        print(f"skipped {run}: {reason}")
    rows = cpu_rows(runs, batch=args.batch, steps=args.steps)
    print_table(rows)
    setup = f"ViT-B-32, 2 ranks x batch {args.batch}, gloo, {args.steps} timed steps"
    write_results("engines", rows, cpu_setup=setup, skipped=[f"{r}: {why}" for r, why in skipped])


def runnable(runs: list[tuple]) -> tuple[list[tuple], list[tuple[tuple, str]]]:
    """The runs whose packages are installed, and the others with the reason."""
    keep, skipped = [], []
    for run in runs:
        needs = (["deepspeed"] if run[0] == "deepspeed" else []) + (
            ["bitsandbytes"] if run[2] == "adamw8bit" else []
        )
        reason = missing_package(*needs)
        (skipped.append((run, reason)) if reason else keep.append(run))
    return keep, skipped


if __name__ == "__main__":
    main()
