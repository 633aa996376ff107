"""Every GPU benchmark row, each in its own process under a timeout: `make bench-gpu`.

    python benchmarks/gpu_suite.py [--quick] [--list] [ROW ...]

Measures the GPU's bf16 peak once (8192^3 matmul) and hands it to every row, so all MFUs share
one denominator. A row whose package is missing is skipped with the reason; one that runs past
its timeout is killed and recorded as such; a crash is recorded with its last output (never as
an out-of-memory). Each row writes its own results/*_gpu.json; this run writes
results/gpu_suite_gpu.json: status, seconds and command of every row. Each row is meant to take
a few minutes on one H100 and the whole suite about 25 (an estimate until the first GPU run
records it); the timeouts are per-row worst cases. Where one command may run at most 10 minutes,
run the rows a few at a time: `make bench-gpu ROWS="engines-fsdp patch-dropout"`.

Optional packages the GPU image lacks (deepspeed, inf-cl, open_clip_torch, the S3 stack) travel
as wheels: see docs/gpu-and-air-gapped.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from common import PEAK_ENV, env_with_checkout, gpu_info, missing_package, print_table, write_results  # noqa: E402


@dataclass(frozen=True)
class Row:
    name: str
    argv: tuple[str, ...]  # after `python`, from the repository root
    timeout_s: int
    needs: tuple[str, ...] = ()
    quick_argv: tuple[str, ...] = ("--quick",)


# Every test marked `gpu`. Not `pytest -m gpu tests`: collecting the whole suite imports the S3,
# DeepSpeed and reference packages a GPU image may lack (tests/test_gpu_image.py).
GPU_TEST_FILES = ("tests/test_gpu_ops.py", "tests/test_gpu_engines.py", "tests/test_gpu_train.py",
                  "tests/test_data_fast_transform.py", "tests/test_local_shards.py")  # fmt: skip

ROWS = [
    Row(
        "gpu-tests",
        ("-m", "pytest", "-q", "-m", "gpu", *GPU_TEST_FILES),
        540,
        ("pytest",),
        (),
    ),  # fmt: skip
    Row("engines-fsdp", ("benchmarks/engines_gpu.py", "--engine", "fsdp"), 540),
    Row("engines-zero3", ("benchmarks/engines_gpu.py", "--engine", "zero3"), 540, ("deepspeed",)),
    Row(
        "peers-vit-h",
        ("benchmarks/train_step_gpu.py", "--row", "peers", "--model", "ViT-H-14"),
        420,
        ("open_clip",),
    ),  # fmt: skip
    Row(
        "peers-vit-bigg",
        ("benchmarks/train_step_gpu.py", "--row", "peers", "--model", "ViT-bigG-14"),
        480,
        ("open_clip",),
    ),  # fmt: skip
    Row(
        "step-variants-bigg",  # issue 30 goals 1-2: OpenCLIP vs bigclip per checkpointing and linear kind
        ("benchmarks/step_variants_gpu.py", "--budget-s", "420"),
        540,
        (),
        ("--steps", "3", "--variants", "openclip:full", "bigclip:ops", "fp8-tensorwise:ops"),
    ),  # fmt: skip
    Row(
        "step-variants-bigg-zero3",
        ("benchmarks/step_variants_gpu.py", "--engine", "zero3", "--variants", "bigclip:full", "bigclip:ops"),
        540,
        ("deepspeed",),
        ("--steps", "3"),
    ),  # fmt: skip
    Row("fp8-loss-curve", ("benchmarks/fp8_loss_curve_gpu.py",), 540, ("torchao",)),
    Row(
        "patch-dropout",
        ("benchmarks/train_step_gpu.py", "--row", "patch-dropout", "--model", "ViT-bigG-14"),
        240,
    ),
    Row("switchback-layers", ("benchmarks/switchback.py", "--no-e2e"), 360, ("triton",)),
    Row("switchback-e2e", ("benchmarks/switchback.py", "--e2e-only"), 300, ("triton",)),
    Row("switchback-diagnose", ("benchmarks/switchback_diagnose.py",), 480, ("triton",), ()),
    Row("loss-vs-infcl", ("benchmarks/loss_infcl_gpu.py",), 300, ("inf_cl", "triton")),
    Row("loss-memory", ("benchmarks/loss_memory.py",), 240, (), ("--quick",)),
    Row("plan-vs-measured", ("benchmarks/plan_vs_measured.py",), 480, (), ()),
    Row(
        "checkpoint-io",
        ("benchmarks/checkpoint_io.py", "--ranks", "1", "--gib", "4", "--name", "checkpoint_io_gpu"),
        300,
        ("boto3", "s3torchconnector", "moto"),
        ("--repeats", "2"),
    ),  # fmt: skip
]


def run_row(row: Row, *, quick: bool, env: dict[str, str]) -> dict:
    command = [sys.executable, *row.argv, *(row.quick_argv if quick else ())]
    result = {"row": row.name, "command": " ".join(command[1:]), "timeout_s": row.timeout_s}
    if reason := missing_package(*row.needs):
        return {**result, "status": "skipped", "detail": reason}
    print(f"\n== {row.name}: {result['command']}", flush=True)
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, timeout=row.timeout_s, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""  # bytes even with text=True: the partial output is not decoded
        tail = (out.decode(errors="replace") if isinstance(out, bytes) else out)[-1500:]
        return {**result, "status": "timeout", "seconds": row.timeout_s, "detail": tail}
    output = done.stdout + done.stderr
    print(done.stdout[-6000:], flush=True)
    skip = next((line for line in done.stdout.splitlines() if line.startswith("SKIP: ")), None)
    status = "failed" if done.returncode else "skipped" if skip else "ok"
    detail = skip[6:] if skip else (output[-2000:] if done.returncode else "")
    return {**result, "status": status, "seconds": round(time.monotonic() - start, 1), "detail": detail}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", help="row names (default: all)")
    parser.add_argument("--quick", action="store_true", help="each row's quick variant")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    args = parser.parse_args()
    unknown = set(args.rows) - {r.name for r in ROWS}
    if args.list or unknown:
        print("\n".join(f"{r.name:18} {r.timeout_s:4d}s  python {' '.join(r.argv)}" for r in ROWS))
        return 2 if unknown else 0
    if not torch.cuda.is_available():
        print("make bench-gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 1
    info = gpu_info()
    print(info, flush=True)
    env = {**env_with_checkout(), PEAK_ENV: str(info["bf16_peak_measured_TFLOPs"])}
    selected = [r for r in ROWS if not args.rows or r.name in args.rows]
    results = [run_row(row, quick=args.quick, env=env) for row in selected]
    print_table(results, ["row", "status", "seconds", "command"])
    write_results("gpu_suite_gpu", results, **info, quick=args.quick)
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
