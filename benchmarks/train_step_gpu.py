"""Training steps on one GPU, side by side in one run: bigclip vs OpenCLIP's own code, and
--force-patch-dropout 0.5 vs none.

    python benchmarks/train_step_gpu.py --row peers --model ViT-H-14 [--batch 128] [--quick]
    python benchmarks/train_step_gpu.py --row peers --model ViT-bigG-14 [--batch 64] [--quick]
    python benchmarks/train_step_gpu.py --row patch-dropout [--model ViT-bigG-14] [--quick]

peers: the same batch, shapes and GPU. OpenCLIP: `open_clip.create_model(model)`,
`ClipLoss(local_loss=True, gather_with_grad=True)`, torch AdamW(fused=True), bf16 autocast,
`set_grad_checkpointing()`, as its trainer runs with `--precision amp_bf16 --grad-checkpointing
--local-loss --gather-with-grad`. bigclip: its FSDP2 engine (a world of one), amp_bf16, grad
checkpointing, compiled blocks, the chunked loss. Each side runs in a fresh process (clean
peak memory), one warm-up step, then --steps timed. Skipped without open_clip (OpenCLIP's
package, open_clip_torch, which imports torchvision).
patch-dropout: the vision tower alone (forward + backward, bf16 autocast, no checkpointing) with
--force-patch-dropout 0.5 vs 0, timed in turns in one process; issue 16's floor is 1.6x.
Each peers row records s/step, samples/s, peak memory, MFU against the datasheet and the
measured bf16 peak (gpu_info) and the flags of the run it reproduces; bigclip's row says whether
issue 24's floors are met (>= 1.2x OpenCLIP's samples/s, >= 40% MFU of the datasheet peak).
Writes results/train_step_<row>_<model>_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import gpu_info, mfu, missing_package, openclip_train_step, print_table, write_gpu_results  # noqa: E402

from bigclip.models.factory import create_model  # noqa: E402
from bigclip.models.families import model_shape  # noqa: E402
from bigclip.models.flops import forward_flops  # noqa: E402
from bigclip.models.named_configs import get_model_config  # noqa: E402

DEFAULT_BATCH = {"ViT-H-14": 128, "ViT-bigG-14": 64}


def timed(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """(median step seconds after one warm-up, peak GiB)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def openclip_step(model_name: str, batch: int) -> Callable[[], None]:
    import open_clip

    model = open_clip.create_model(model_name, device="cuda")
    model.set_grad_checkpointing(True)
    loss_fn = open_clip.ClipLoss(local_loss=True, gather_with_grad=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    cfg = get_model_config(model_name)
    size, context = cfg.vision_cfg.image_size, cfg.text_cfg.context_length
    images = torch.randn(batch, 3, size, size, device="cuda")
    texts = torch.randint(1, cfg.text_cfg.vocab_size - 1, (batch, context), device="cuda")
    texts[:, -1] = cfg.text_cfg.vocab_size - 1
    return openclip_train_step(model, loss_fn, opt, images, texts)


def bigclip_step(model_name: str, batch: int) -> Callable[[], None]:
    from engines_gpu import build, config

    from bigclip.models.from_config import synthetic_batch
    from bigclip.ops.loss.contrastive import build_loss
    from bigclip.train.trainer import train_step

    cfg = config("fsdp", compiled=True, model=model_name)
    engine, loss_fn = build(cfg), build_loss(cfg.loss)
    micro = [synthetic_batch(cfg, device="cuda", batch_size=batch)]
    return lambda: train_step(engine, loss_fn, micro, lr=cfg.optim.lr) and None


# OpenCLIP's trainer flags that openclip_step reproduces.
OPENCLIP_FLAGS = "--precision amp_bf16 --grad-checkpointing --local-loss --gather-with-grad (fused AdamW)"
GOAL_SPEEDUP, GOAL_MFU = 1.2, 0.40  # issue 24's floors: samples/s vs OpenCLIP, MFU of the datasheet peak


def bigclip_flags(model_name: str) -> str:
    """The bigclip run bigclip_step measures, as `python -m bigclip.train` flags."""
    from engines_gpu import config

    cfg = config("fsdp", compiled=True, model=model_name)
    flags = [f"--engine {cfg.engine.engine}", f"--precision {cfg.engine.precision}"]
    flags += ["--grad-checkpointing"] * cfg.model.grad_checkpointing + [
        "--torchcompile"
    ] * cfg.model.torchcompile
    flags += [f"--loss-chunk-size {cfg.loss.loss_chunk_size}", "--local-loss --gather-with-grad"]
    kind = cfg.model.linear_kind
    return " ".join(flags + ([f"--linear-kind {kind}"] if kind != "none" else []))


def one_side(impl: str, model_name: str, batch: int, steps: int) -> dict:
    make = openclip_step if impl == "openclip" else bigclip_step
    step_s, peak = timed(make(model_name, batch), steps)
    flags = OPENCLIP_FLAGS if impl == "openclip" else bigclip_flags(model_name)
    return {"step_s": step_s, "peak_GiB": peak, "flags": flags}


def judge(rows: list[dict]) -> None:
    """Side by side: bigclip's speed-up and memory against OpenCLIP's, and issue 24's floors."""
    if not all("step_s" in r for r in rows):
        return
    ours = rows[1]
    ours["speedup_vs_openclip"] = rows[0]["step_s"] / ours["step_s"]
    ours["memory_vs_openclip"] = ours["peak_GiB"] / rows[0]["peak_GiB"]
    ours["goal_speedup_1.2x_met"] = ours["speedup_vs_openclip"] >= GOAL_SPEEDUP
    sheet = ours.get("mfu_vs_datasheet_peak")
    ours["goal_mfu_40pct_datasheet_met"] = sheet >= GOAL_MFU if sheet is not None else None


def peers(model_name: str, batch: int, steps: int) -> list[dict]:
    info, flops = gpu_info(), 3 * forward_flops(model_shape(model_name)) * batch
    rows = []
    for impl in ("openclip", "bigclip"):
        argv = [sys.executable, __file__, "--side", impl, "--model", model_name, "--batch", str(batch)]
        done = subprocess.run([*argv, "--steps", str(steps)], capture_output=True, text=True, cwd=ROOT)
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        row = {"impl": impl, "model": model_name, "batch": batch}
        if not lines:
            rows.append({**row, "error": (done.stderr or done.stdout)[-1500:]})
            continue
        side = json.loads(lines[-1])
        rows.append(
            {**row, **side, "samples_per_s": batch / side["step_s"], **mfu(flops / side["step_s"], info)}
        )
    judge(rows)
    return rows


def patch_dropout(model_name: str, batch: int, steps: int) -> list[dict]:
    towers = {p: create_model(model_name, device="cuda", patch_dropout=p).visual for p in (0.0, 0.5)}
    size = get_model_config(model_name).vision_cfg.image_size
    images = torch.randn(batch, 3, size, size, device="cuda")

    def step(tower: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = tower(images)
            out.float().sum().backward()
            tower.zero_grad(set_to_none=True)

        return run

    times: dict[float, list[float]] = {0.0: [], 0.5: []}
    for _ in range(steps):  # in turns: clock or load drift hits both
        for p, tower in towers.items():
            times[p].append(timed(step(tower), 1)[0])
    base, dropped = statistics.median(times[0.0]), statistics.median(times[0.5])
    row = {"model": model_name, "batch": batch, "tower": "vision", "step_s_no_dropout": base}
    return [
        row
        | {"step_s_dropout_0.5": dropped, "speedup": base / dropped, "floor_1.6x_met": base / dropped >= 1.6}
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=("peers", "patch-dropout"), default="peers")
    parser.add_argument("--model", default="ViT-H-14", choices=sorted(DEFAULT_BATCH))
    parser.add_argument("--batch", type=int, default=0, help="per step (default: 128 H-14, 64 bigG-14)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default 8; 3 with --quick)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--side", choices=("openclip", "bigclip"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    batch, steps = args.batch or DEFAULT_BATCH[args.model], args.steps or (3 if args.quick else 8)
    reason = "needs a CUDA GPU" if not torch.cuda.is_available() else None
    if args.row == "peers" and not reason:
        reason = missing_package("open_clip")
    if reason:
        print(f"SKIP: {reason}")
        return 0
    if args.side:
        print(json.dumps(one_side(args.side, args.model, batch, steps)))
        return 0
    rows = peers(args.model, batch, steps) if args.row == "peers" else patch_dropout(args.model, batch, steps)
    print_table(rows)
    name = f"train_step_{args.row.replace('-', '_')}_{args.model.replace('-', '_')}"
    write_gpu_results(name, rows, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
