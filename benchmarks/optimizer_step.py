"""The AdamW step bigclip uses (torch's fused AdamW, engines/optimizer.py) against torch's default
foreach AdamW and DeepSpeed's CPU Adam, on a real model's parameters, side by side.

    PYTHONPATH=$PWD python benchmarks/optimizer_step.py [--model ViT-B-32] [--steps 7]

The model's fp32 parameters in bigclip's two weight-decay groups, random gradients, lr 1e-3,
wd 0.2, on the CPU: where ZeRO-Offload steps the optimizer, and where DeepSpeed would otherwise
build DeepSpeedCPUAdam (a ds_config "optimizer" section; compiled with ninja/gcc on first use,
the build is timed). The GPU rows run the same fused AdamW inside the training step.
Measured:
  step ms        median over --steps steps (the first, which allocates the state, left out), the
                 optimizers alternating in one process;
  first-step MB  growth of the peak RSS across the first step, in a fresh process per optimizer:
                 the two moments it creates (expected: 8 bytes per parameter) plus any temporary
                 (foreach's sqrt(exp_avg_sq), 4 bytes per parameter, which bigclip's planner
                 no longer counts for --optimizer adamw);
  agreement      largest parameter difference from foreach AdamW after --steps identical steps,
                 relative to the largest parameter.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import missing_package, print_table, write_results  # noqa: E402

from bigclip.config import OptimConfig  # noqa: E402
from bigclip.engines.optimizer import make_optimizer, param_groups  # noqa: E402
from bigclip.models.factory import create_model  # noqa: E402

OPTIM = OptimConfig(lr=1e-3, wd=0.2)
LABELS = {
    "foreach": "torch AdamW foreach (torch's default)",
    "fused": "torch AdamW fused (bigclip)",
    "deepspeed": "DeepSpeedCPUAdam",
}


def model_with_gradients(name: str) -> torch.nn.Module:
    model = create_model(name, device="cpu")
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    return model


def build(impl: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay=OPTIM.wd)
    hyper = dict(lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    if impl == "fused":
        optimizer = make_optimizer(groups, OPTIM)  # what bigclip's engines step
        assert optimizer.defaults["fused"], "make_optimizer no longer picks fused AdamW on the CPU"
        return optimizer
    if impl == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **hyper)
    return torch.optim.AdamW(groups, foreach=True, **hyper)


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def first_step_growth(impl: str, name: str, out: multiprocessing.Queue) -> None:
    model = model_with_gradients(name)
    optimizer = build(impl, model)
    before = max_rss_mb()
    optimizer.step()
    out.put(max_rss_mb() - before)


def measure_growth(impl: str, name: str) -> float:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=first_step_growth, args=(impl, name, out))
    proc.start()
    growth = out.get(timeout=900)
    proc.join()
    return growth


def build_seconds(impl: str) -> float:
    """DeepSpeedCPUAdam compiles its C++ op on first use (cached under ~/.cache/torch_extensions)."""
    start = time.perf_counter()
    build(impl, torch.nn.Linear(2, 2))
    return time.perf_counter() - start


def step_times_and_agreement(name: str, impls: list[str], steps: int) -> tuple[dict, dict]:
    models = {impl: model_with_gradients(name) for impl in impls}
    optimizers = {impl: build(impl, models[impl]) for impl in impls}
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(steps):
        for impl in impls:
            start = time.perf_counter()
            optimizers[impl].step()
            times[impl].append(time.perf_counter() - start)
    with torch.no_grad():
        reference = list(models["foreach"].parameters())
        scale = max(float(p.abs().max()) for p in reference)
        agreement = {
            impl: max(float((a - b).abs().max()) for a, b in zip(reference, models[impl].parameters()))
            / scale
            for impl in impls
        }
    return {impl: t[1:] for impl, t in times.items()}, agreement


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()

    impls = ["foreach", "fused"]
    skipped = missing_package("deepspeed")
    built = {"deepspeed": build_seconds("deepspeed")} if not skipped else {}
    impls += list(built)
    numel = sum(p.numel() for p in create_model(args.model).parameters())
    growth = {impl: measure_growth(impl, args.model) for impl in impls}
    times, agreement = step_times_and_agreement(args.model, impls, args.steps)
    step_ms = {impl: 1e3 * statistics.median(t) for impl, t in times.items()}
    rows = [
        {
            "optimizer": LABELS[impl],
            "step_ms": step_ms[impl],
            "step_vs_fused": step_ms[impl] / step_ms["fused"],
            "first_step_growth_mb": growth[impl],
            "bytes_per_param": growth[impl] * 2**20 / numel,
            "max_param_diff_rel": agreement[impl],
            "build_s": built.get(impl),
        }
        for impl in impls
    ]
    print(f"{args.model}: {numel / 1e6:.1f} M parameters, {torch.get_num_threads()} threads")
    print_table(rows)
    if skipped:
        print(f"DeepSpeedCPUAdam left out: {skipped}")
    write_results("optimizer_step", rows, model=args.model, parameters=numel, steps=args.steps)


if __name__ == "__main__":
    main()
