"""fp8 linears against bf16 over a real training run: loss curves of ViT-B-32 on demo data.

    python benchmarks/fp8_loss_curve_gpu.py [--steps 200] [--batch 256] [--quick]

Four runs of `python -m bigclip.train` on one GPU, the same flags but for the linear kind and the
seed (every linear converted: --linear-filter all): bf16 (none) with seeds 0 and 1 (their difference is the run-to-run spread), then
fp8-tensorwise and fp8-rowwise with seed 0. Each run logs its loss every step to TensorBoard; the
curves are smoothed over a 20-step window. The fp8 goal (issue 30): after the warm-up, each fp8
curve stays within the bf16 runs' spread of their mean (the spread at that step, or the largest
one over the neighbouring 20 steps) at >= 90% of the steps, and its final loss (mean of the last
20 steps) within the spread of the bf16 runs' final losses. Writes results/fp8_loss_curve_gpu.json
with every curve.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import env_with_checkout, print_table, write_gpu_results  # noqa: E402

RUNS = (("bf16-seed0", "none", 0), ("bf16-seed1", "none", 1), ("fp8-tensorwise", "fp8-tensorwise", 0),
        ("fp8-rowwise", "fp8-rowwise", 0))  # fmt: skip
WINDOW = 20
LEARNED = 0.9  # bf16's final loss under this share of chance: the curves carry a signal


def make_data(out: Path, samples: int, image_size: int) -> str:
    subprocess.run([sys.executable, "-m", "bigclip", "make-demo-data", str(out), "--samples", str(samples),
                    "--shards", "16", "--val-samples", "64", "--image-size", str(image_size), "--no-progress"],
                   check=True, cwd=ROOT, env=env_with_checkout())  # fmt: skip
    return str(out / "train" / "{00000..00015}.tar")


def train(args: argparse.Namespace, data: str, logs: Path, name: str, kind: str, seed: int) -> list[float]:
    argv = ["--model", args.model, "--train-data", data, "--train-num-samples", str(args.samples),
            "--batch-size", str(args.batch), "--max-steps", str(args.steps), "--epochs", "1000",
            "--lr", "5e-4", "--warmup", str(args.steps // 10), "--precision", "amp_bf16",
            "--linear-kind", kind, "--linear-filter", "all", "--seed", str(seed), "--workers", str(args.workers), "--log-every-n-steps", "1",
            "--logs", str(logs), "--name", name, "--save-every-n-steps", "0", "--save-frequency", "0"]  # fmt: skip
    env = env_with_checkout()
    done = subprocess.run([sys.executable, "-m", "bigclip.train", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=args.run_timeout_s)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logs / name / "tensorboard"))
    events.Reload()
    return [e.value for e in sorted(events.Scalars("train/loss"), key=lambda e: e.step)]


def smooth(curve: list[float]) -> list[float]:
    return [sum(curve[max(0, i - WINDOW + 1) : i + 1]) / len(curve[max(0, i - WINDOW + 1) : i + 1])
            for i in range(len(curve))]  # fmt: skip


def judge(curves: dict[str, list[float]], warmup: int, batch: int) -> list[dict]:
    """Each run's final loss and share of steps within the bf16 spread; an fp8 run's verdict. No
    verdict where the bf16 runs never left chance (a contrastive loss of log(batch)): flat curves
    agree whatever the linears compute, so they say nothing about fp8."""
    a, b = smooth(curves["bf16-seed0"]), smooth(curves["bf16-seed1"])
    n = min(len(a), len(b))
    mean = [(a[i] + b[i]) / 2 for i in range(n)]
    spread = [max(abs(a[j] - b[j]) for j in range(max(0, i - 10), min(n, i + 11))) for i in range(n)]
    finals = {name: sum(c[-WINDOW:]) / len(c[-WINDOW:]) for name, c in curves.items()}
    lo, hi = sorted((finals["bf16-seed0"], finals["bf16-seed1"]))
    learned = hi < LEARNED * math.log(batch)
    no_signal = f"no signal: bf16 stayed near chance (log {batch} = {math.log(batch):.3f})"
    rows = []
    for name, curve in curves.items():
        s = smooth(curve)
        inside = [abs(s[i] - mean[i]) <= spread[i] for i in range(warmup, min(n, len(s)))]
        share = sum(inside) / max(len(inside), 1)
        final_ok = lo - (hi - lo) <= finals[name] <= hi + (hi - lo)
        row = {"run": name, "steps": len(curve), "final_loss": finals[name], "share_within_spread": share}
        if name.startswith("fp8"):
            ok = share >= 0.9 and final_ok
            row["goal_met"] = ok if learned else None
            row["verdict"] = f"{'within' if ok else 'outside'} the bf16 spread" if learned else no_signal
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--run-timeout-s", type=int, default=240)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--quick", action="store_true", help="60 steps of batch 128")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="the tiny model for 8 steps on CPU, no results"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch, args.samples = 60, 128, 4096
    # The CPU smoke run (tests/test_fp8_loss_curve.py) checks the pipeline, so that a GPU run
    # cannot fail for a reason of its own.
    if args.cpu_smoke:
        args.model, args.steps, args.batch, args.samples, args.workers = "tiny", 8, 16, 256, 1
        args.run_timeout_s = 600  # a busy CI core, not a GPU
    elif not torch.cuda.is_available():
        print("SKIP: needs a CUDA GPU")
        return 0
    from bigclip.models.named_configs import get_model_config

    image_size = get_model_config(args.model).vision_cfg.image_size
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(Path(tmp) / "data", args.samples, image_size)
        curves, seconds = {}, {}
        for name, kind, seed in RUNS:
            start = time.monotonic()
            curves[name] = train(args, data, Path(tmp) / "logs", name, kind, seed)
            seconds[name] = round(time.monotonic() - start, 1)
            print(json.dumps({"run": name, "seconds": seconds[name], "final": curves[name][-1]}), flush=True)
    rows = judge(curves, warmup=args.steps // 10 + WINDOW, batch=args.batch)
    for row in rows:
        row["seconds"] = seconds[row["run"]]
    print_table(rows)
    if args.cpu_smoke:
        return 0
    write_gpu_results("fp8_loss_curve", rows, curves=curves, steps=args.steps, batch=args.batch,
                      model=args.model, quick=args.quick)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
