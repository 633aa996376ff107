"""SwitchBack int8 linears vs 16-bit nn.Linear: forward+backward time per layer, and on a GPU an
end-to-end ViT-H-14 training step.

Per layer: the MLP shapes of ViT-bigG-14 (1664<->8192) and ViT-H-14 (1280<->5120) at 8k to
131k tokens; each variant is timed against nn.Linear on the same inputs in the same run and
reported as a ratio (speed-up = 16-bit time / int8 time). Gradients are taken with
torch.autograd.grad for x, W and b alike, so no .grad accumulation is timed. The reference
is a bf16 nn.Linear. On a GPU int8 runs the Triton kernels ("global-torch": the torch._int_mm
path, for comparison); on CPU it is the PyTorch path (torch._int_mm; this CPU has AVX512-BF16
and VNNI), token counts are scaled down, and the figures are for the record, not a goal.

    python benchmarks/switchback.py [--quick] [--no-e2e | --e2e-only]
    python benchmarks/switchback.py --diagnose [--small]   (benchmarks/switchback_diagnose.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # runs as `python benchmarks/switchback.py`

from common import gpu_info, print_table, write_results  # noqa: E402

from bigclip.ops.int8.custom_ops import BACKEND_ENV  # noqa: E402
from bigclip.ops.int8.switchback import LINEAR_CLASSES, apply_int8  # noqa: E402

SHAPES = [(1664, 8192), (8192, 1664), (1280, 5120), (5120, 1280)]
GPU_TOKENS = [8192, 16384, 32768, 65536, 131072]
GPU_TOKENS_QUICK = [16384, 65536]
CPU_TOKENS = [1024, 2048]
CPU_TOKENS_QUICK = [512]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_ms(fns: dict[str, Callable[[], object]], device: torch.device, *, warmup: int, reps: int) -> dict:
    """Median milliseconds of each function, timed in turns (one call of each per round), so
    drift in clocks or in the load of a shared machine hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):  # also autotunes the Triton GEMM for these sizes
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_elapsed_ms(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


def _fwd_bwd(layer: nn.Linear, x: torch.Tensor, grad: torch.Tensor, backend: str) -> Callable[[], object]:
    params = (x, layer.weight, layer.bias)

    def run() -> object:
        os.environ[BACKEND_ENV] = backend
        return torch.autograd.grad(layer(x), params, grad)

    return run


def _saved_mib(layer: nn.Linear, x: torch.Tensor, backend: str) -> float:
    """GPU memory the forward keeps for backward, beyond its output."""
    os.environ[BACKEND_ENV] = backend
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = layer(x)
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return round(kept / 2**20, 1)


def _variants(device: torch.device) -> dict[str, tuple[type[nn.Linear], str]]:
    variants = {q: (cls, "auto") for q, cls in LINEAR_CLASSES.items()}
    if device.type == "cuda":
        variants["global-torch"] = (LINEAR_CLASSES["global"], "torch")  # torch._int_mm, unfused epilogue
    return variants


def bench_layer(
    in_f: int, out_f: int, tokens: int, device: torch.device, dtype: torch.dtype, *, reps: int
) -> list[dict]:
    ref = nn.Linear(in_f, out_f, device=device, dtype=dtype)
    x = torch.randn(tokens, in_f, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, out_f, device=device, dtype=dtype)
    layers = {name: (cls.from_linear(ref), backend) for name, (cls, backend) in _variants(device).items()}
    fns = {"ref": _fwd_bwd(ref, x, grad, "auto")}
    fns |= {name: _fwd_bwd(layer, x, grad, backend) for name, (layer, backend) in layers.items()}
    ms = time_ms(fns, device, warmup=3 if device.type == "cuda" else 1, reps=reps)
    rows = []
    for name, (layer, backend) in layers.items():
        row = {"shape": f"{in_f}->{out_f}", "tokens": tokens, "variant": name}
        row |= {
            "ref_ms": round(ms["ref"], 3),
            "int8_ms": round(ms[name], 3),
            "speedup": round(ms["ref"] / ms[name], 3),
        }
        if device.type == "cuda":
            row |= {
                "ref_saved_MiB": _saved_mib(ref, x, "auto"),
                "int8_saved_MiB": _saved_mib(layer, x, backend),
            }
        rows.append(row)
    os.environ[BACKEND_ENV] = "auto"
    return rows


E2E_VARIANTS = [
    ("none", False),
    ("switchback-global", False),
    ("switchback-vectorwise", False),
    ("switchback-memefficient", False),
    ("switchback-global", True),
]


def bench_e2e(model_name: str, batch: int, device: torch.device, *, steps: int) -> list[dict]:
    """A training step (amp_bf16: fp32 weights, bf16 autocast; ClipLoss; fused AdamW): plain, then
    the same model and optimizer with each int8 variant swapped in (apply_int8 swaps in place)."""
    from bigclip.models.factory import create_model
    from bigclip.ops.loss.contrastive import ClipLoss

    model = create_model(model_name, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    images = torch.randn(batch, 3, model.image_size, model.image_size, device=device)
    texts = torch.randint(1, 49407, (batch, model.context_length), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images, texts)
            loss = ClipLoss()(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows = []
    for mode, attention in E2E_VARIANTS:
        if mode != "none":
            apply_int8(model, mode, include_attention=attention)
        torch.cuda.reset_peak_memory_stats()
        ms = time_ms({"step": step}, device, warmup=3, reps=steps)["step"]
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        rows.append({"model": model_name, "batch": batch, "int8": mode, "attention": attention})
        rows[-1] |= {
            "step_ms": round(ms, 1),
            "speedup": round(rows[0].get("step_ms", ms) / ms, 3),
            "peak_GiB": peak,
        }
    return rows


def _default_e2e_batch() -> int:
    # ViT-H-14 without activation checkpointing: ~0.6 GiB of activations per image in amp_bf16.
    return 128 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 64


def floor_check(rows: list[dict], e2e: list[dict]) -> dict:
    """The issue's H100 floors, read off this run: per layer at >= 64k tokens, and end to end."""
    large = [r["speedup"] for r in rows if r["tokens"] >= 65536 and r["variant"] == "global"]
    step = [r["speedup"] for r in e2e if r["int8"] == "switchback-global" and not r["attention"]]
    return {
        "min_layer_speedup_64k_plus": min(large, default=None),
        "layer_floor_1.4x_met": bool(large) and min(large) >= 1.4,
        "e2e_speedup": step[0] if step else None,
        "e2e_floor_1.15x_met": bool(step) and step[0] >= 1.15,
    }


def _token_counts(on_gpu: bool, quick: bool) -> list[int]:
    if on_gpu:
        return GPU_TOKENS_QUICK if quick else GPU_TOKENS
    return CPU_TOKENS_QUICK if quick else CPU_TOKENS


def main() -> None:
    if "--diagnose" in sys.argv[1:]:  # Triton vs PyTorch, kernel by kernel: its own script
        from switchback_diagnose import main as diagnose

        sys.exit(diagnose([a for a in sys.argv[1:] if a != "--diagnose"]))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer token counts and repetitions")
    parser.add_argument(
        "--diagnose", action="store_true", help="compare Triton with PyTorch instead (switchback_diagnose.py)"
    )
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end ViT-H-14 step (GPU)")
    parser.add_argument("--e2e-only", action="store_true", help="only the end-to-end ViT-H-14 step (GPU)")
    parser.add_argument(
        "--e2e-batch", type=int, default=0, help="images per step end to end (0: by GPU memory)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    reps = (5 if args.quick else 20) if on_gpu else (3 if args.quick else 5)
    rows = []
    for in_f, out_f in [] if args.e2e_only else SHAPES:
        for tokens in _token_counts(on_gpu, args.quick):
            rows += bench_layer(in_f, out_f, tokens, device, torch.bfloat16, reps=reps)
            print_table(rows[-len(_variants(device)) :])
    print("\nper layer, forward+backward (speedup = bf16 nn.Linear ms / int8 ms)")
    print_table(rows)
    e2e = []
    if on_gpu and not args.no_e2e:
        batch = args.e2e_batch or _default_e2e_batch()
        e2e = bench_e2e("ViT-H-14", batch, device, steps=5 if args.quick else 10)
        print("\nend-to-end training step")
        print_table(e2e)
    extra = {"reference_dtype": "bfloat16", "quick": args.quick, "e2e": e2e}
    extra["backend"] = "triton" if on_gpu else "torch._int_mm (CPU)"
    name = "switchback"
    if on_gpu:
        extra["floors"] = floor_check(rows, e2e)
        print("\nfloors:", extra["floors"])
        extra |= gpu_info()
        name += "_e2e_gpu" if args.e2e_only else "_layers_gpu" if args.no_e2e else "_gpu"
    write_results(name, rows, **extra)


if __name__ == "__main__":
    main()
