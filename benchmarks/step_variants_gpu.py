"""One model's training step on one GPU, variant by variant in one run: OpenCLIP's own step beside
bigclip's with each activation-checkpointing setting and linear kind (bf16, fp8 tensorwise/rowwise).

    python benchmarks/step_variants_gpu.py [--model ViT-bigG-14] [--batch 64] [--steps 6]
        [--variants openclip:full bigclip:full bigclip:ops bigclip:every2 fp8-tensorwise:ops ...]
        [--engine fsdp|zero3] [--budget-s 540] [--profile]

A variant is SIDE:CHECKPOINTING, SIDE one of openclip (OpenCLIP's create_model + ClipLoss + fused
AdamW under bf16 autocast, as `train_step_gpu.py --row peers` runs it), bigclip (bf16 linears) or
fp8-tensorwise / fp8-rowwise (bigclip with torchao's float8 linears where the measured shape table
says they are faster: --linear-filter auto; with "+all", e.g. fp8-rowwise+all, in every linear),
and a bigclip side may add "+fsdp2" (FSDP2 even at a world of one, where the FSDP engine keeps a
plain module with fp32 masters), with "+unitsN" (--fsdp-blocks-per-unit N) and "+keep"
(--no-reshard-after-forward), the host-time levers of benchmarks/host_overhead.py; CHECKPOINTING one of none,
full, ops (torchtitan's op-level selective checkpointing) or everyN (every Nth block). bigclip
sides run the FSDP engine (or ZeRO-3 with --engine zero3) in a world of one, amp_bf16,
compiled blocks and the chunked loss. Each variant runs in a fresh process (clean peak memory;
an out-of-memory variant is recorded as such) after one warm-up step; variants are not started
once --budget-s is spent, so a bounded command still writes every finished row. Samples/s, peak
memory and MFU (3 x forward FLOPs, recomputation not counted, over the datasheet peak) per row;
speed-ups against the first row of each SIDE. Writes results/step_variants_<model>_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import PEAK_ENV, gpu_info, mfu, print_table, write_gpu_results  # noqa: E402

from bigclip.models.families import model_shape  # noqa: E402
from bigclip.models.flops import forward_flops  # noqa: E402

SIDES = ("openclip", "bigclip", "fp8-tensorwise", "fp8-rowwise")
DEFAULT_VARIANTS = (
    "openclip:full",
    "bigclip:full",
    "bigclip:ops",
    "bigclip+fsdp2+units16+keep:ops",
    "fp8-tensorwise:ops",
    "fp8-tensorwise+all:ops",
)


def parse_variant(text: str) -> tuple[str, str, int]:
    side, _, ckpt = text.partition(":")
    ckpt = ckpt or "full"
    base, *mods = side.split("+")
    known = all(m in ("all", "keep", "fsdp2") or (m.startswith("units") and m[5:].isdigit()) for m in mods)
    if base not in SIDES or not known or not (ckpt in ("none", "full", "ops") or ckpt.startswith("every")):
        raise SystemExit(
            f"variant {text!r}: expected SIDE[+all|+fsdp2|+unitsN|+keep]:CHECKPOINTING, SIDE in {SIDES}"
        )
    every = int(ckpt[5:]) if ckpt.startswith("every") else 1
    return side, ckpt, every


def bigclip_step(model_name: str, batch: int, side: str, ckpt: str, every: int, engine: str):
    from engines_gpu import config

    from bigclip.distributed import free_port, init_distributed
    from bigclip.engines import build_engine
    from bigclip.models.from_config import build_model, model_factory, synthetic_batch
    from bigclip.ops.loss.contrastive import build_loss
    from bigclip.train.trainer import train_step

    cfg = config(engine, compiled=True, model=model_name)
    cfg.model.grad_checkpointing = ckpt != "none"
    cfg.model.grad_checkpointing_every = every
    cfg.model.grad_checkpointing_policy = "ops" if ckpt == "ops" else "full"
    base, *mods = side.split("+")
    cfg.model.linear_kind = base if base.startswith("fp8-") else "none"
    cfg.model.linear_filter = "all" if "all" in mods else "auto"
    cfg.engine.reshard_after_forward = "keep" not in mods
    cfg.engine.fsdp_blocks_per_unit = next((int(m[5:]) for m in mods if m.startswith("units")), 1)
    cfg.validate()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    eng = build_engine(cfg, init_distributed())
    if "fsdp2" in mods:
        eng.world_of_one = False
    eng.build(build_model(cfg), rebuild=model_factory(cfg))
    loss_fn = build_loss(cfg.loss)
    micro = [synthetic_batch(cfg, device="cuda", batch_size=batch)]
    return lambda: train_step(eng, loss_fn, micro, lr=cfg.optim.lr) and None


def kernel_profile(step, top: int = 12) -> dict:
    """One profiled step: GPU-busy milliseconds and the kernels that took the most of them (where
    the time goes when a variant is slower than its arithmetic says)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    rows = [{"kernel": e.key[:90], "ms": round(e.self_device_time_total / 1e3, 2), "calls": e.count}
            for e in kernels[:top]]  # fmt: skip
    return {"gpu_busy_ms": round(busy_ms, 1), "top_kernels": rows}


def one_variant(model_name: str, batch: int, steps: int, variant: str, engine: str, profile: bool) -> dict:
    from train_step_gpu import openclip_step, timed

    side, ckpt, every = parse_variant(variant)
    if side == "openclip":
        if ckpt not in ("full", "none"):
            raise SystemExit("openclip sides take full or none (its trainer has no selective checkpointing)")
        step = openclip_step(model_name, batch)
    else:
        step = bigclip_step(model_name, batch, side, ckpt, every, engine)
    step_s, peak = timed(step, steps)
    return {"step_s": step_s, "peak_GiB": peak, **(kernel_profile(step) if profile else {})}


def run_variant(args: argparse.Namespace, variant: str, info: dict, flops: float) -> dict:
    argv = [sys.executable, __file__, "--one", variant, "--model", args.model, "--batch", str(args.batch)]
    argv += ["--steps", str(args.steps), "--engine", args.engine] + (["--profile"] if args.profile else [])
    row: dict = {"variant": variant, "engine": "openclip" if variant.startswith("openclip") else args.engine}
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=args.variant_timeout_s)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timeout after {args.variant_timeout_s} s"}
    row["seconds"] = round(time.monotonic() - start, 1)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if not lines:
        tail = (done.stderr or done.stdout)[-1200:]
        return {**row, "error": "out of memory" if "OutOfMemoryError" in tail else tail}
    side = json.loads(lines[-1])
    return {**row, **side, "samples_per_s": args.batch / side["step_s"], **mfu(flops / side["step_s"], info)}


def compare(rows: list[dict]) -> None:
    """Speed-ups against OpenCLIP's first row and against bigclip's best bf16 row."""
    done = [r for r in rows if "step_s" in r]
    base = next((r for r in done if r["variant"].startswith("openclip")), None)
    bf16 = min(
        (r for r in done if r["variant"].startswith("bigclip")), key=lambda r: r["step_s"], default=None
    )
    for r in done:
        if base:
            r["speedup_vs_openclip"] = base["step_s"] / r["step_s"]
        if bf16 and r["variant"].startswith("fp8"):
            r["speedup_vs_best_bf16"] = bf16["step_s"] / r["step_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT-bigG-14")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--engine", choices=("fsdp", "zero3"), default="fsdp")
    parser.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--budget-s", type=float, default=540, help="start no variant after this")
    parser.add_argument("--variant-timeout-s", type=int, default=300)
    parser.add_argument("--name", default="")
    parser.add_argument(
        "--profile", action="store_true", help="add one profiled step's top kernels per variant"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for v in args.variants:
        parse_variant(v)
    if not torch.cuda.is_available():
        print("SKIP: needs a CUDA GPU")
        return 0
    if args.one:
        print(
            json.dumps(one_variant(args.model, args.batch, args.steps, args.one, args.engine, args.profile))
        )
        return 0
    info, start = gpu_info(), time.monotonic()
    os.environ[PEAK_ENV] = str(info["bf16_peak_measured_TFLOPs"])  # measured once, for every row
    flops = 3 * forward_flops(model_shape(args.model)) * args.batch
    rows: list[dict] = []
    name = args.name or f"step_variants_{args.model.replace('-', '_')}_{args.engine}"
    for variant in args.variants:
        if time.monotonic() - start > args.budget_s:
            rows.append({"variant": variant, "error": "not started: --budget-s spent"})
            continue
        rows.append(run_variant(args, variant, info, flops))
        print(json.dumps(rows[-1]), flush=True)
        compare(rows)
        write_gpu_results(name, rows, model=args.model, batch=args.batch, steps=args.steps)
    print_table(rows, ["variant", "engine", "step_s", "samples_per_s", "peak_GiB", "mfu_vs_datasheet_peak",
                       "speedup_vs_openclip", "speedup_vs_best_bf16", "error"])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
