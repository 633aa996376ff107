"""SwitchBack diagnostic: every Triton kernel and each of the layer's four outputs (y, input,
weight and bias gradients) against the PyTorch path (bigclip.ops.int8.torch_path) on this
device, in one table that says which one disagrees and by how much.

    python benchmarks/switchback_diagnose.py [--small] [--out PATH]
    python benchmarks/switchback.py --diagnose            (the same)

Kernels: row-wise, tensor-wise and column-wise quantisation (forward and backward calls),
dequantisation (memefficient's backward), and the int8 GEMM bare (int32) and with each
dequantising epilogue (forward y / backward grad_x, global / vectorwise scaling), once per
tile the GPU may autotune to (kernels.GEMM_CONFIGS, forced one at a time) and once as
launched by default. The layer: global, vectorwise and memefficient in pure bf16 and in
amp_bf16 (fp32 weights, bf16 autocast, a transposed output gradient), each backend on its own
copy of the nn.Linear. Everything must be bit-identical (see tests/support/switchback_selfcheck.py).

On a GPU: ViT-H-14 sizes (4112 tokens, 1280 <-> 5120; kernels at 4133 x 1288 x 1304, multiples
of no tile), results/switchback_diagnose_gpu.json. On CPU it needs TRITON_INTERPRET=1 in the
environment and runs `--small` sizes (results/switchback_diagnose_interpreter.json). Exit 1
if any check disagrees.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]  # runs as `python benchmarks/...`

from common import RESULTS_DIR, device_description, git_commit, gpu_info, print_table  # noqa: E402

COLUMNS = ["check", "shape", "dtype", "ok", "differ", "max_abs", "max_ulps"]
# (tokens as lead dims, in, out) of the layer; (M, N, K) of the kernels.
FULL = {"lead": (16, 257), "features": (1280, 5120), "kernels": (4133, 1288, 1304)}
SMALL = {"lead": (3, 50), "features": (80, 48), "kernels": (150, 48, 80)}


def kernel_rows(sizes: dict, device: torch.device) -> list[dict]:
    from support import switchback_selfcheck as selfcheck

    from bigclip.ops.int8 import kernels

    m, n, k = sizes["kernels"]
    rows = selfcheck.check_quantizers(m, n, k, device)
    default = "[interpreter tile]" if kernels.interpreting() else "[autotuned]"
    rows += selfcheck.check_gemms(m, n, k, device, label=default)
    for config in kernels.GEMM_CONFIGS:
        label = "[{BLOCK_M}x{BLOCK_N}x{BLOCK_K}]".format(**config.kwargs)
        label += f" s{config.num_stages} w{config.num_warps}"
        with kernels.launch_as_gpu(config):
            rows += selfcheck.check_gemms(m, n, k, device, label=label)
    return rows


def layer_rows(sizes: dict, device: torch.device) -> list[dict]:
    from support.switchback_selfcheck import LayerCase, check_layer

    calls = [{}, {"param_dtype": torch.float32, "autocast": torch.bfloat16, "grad_layout": "transposed"}]
    rows = []
    for quantization in ("global", "vectorwise", "memefficient"):
        for call in calls:
            case = LayerCase(quantization, sizes["lead"], *sizes["features"], **call)
            rows += check_layer(case, device)
    return rows


def _write(rows: list[dict], out: Path, *, device: torch.device, small: bool) -> None:
    import triton
    from support.switchback_selfcheck import failures

    payload = {
        "benchmark": out.stem,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": device_description(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "interpreted": os.environ.get("TRITON_INTERPRET") == "1",
        "small": small,
        "ok": all(r["ok"] for r in rows),
        "failures": failures(rows).splitlines(),
    }
    if device.type == "cuda":
        payload |= gpu_info()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload | {"rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="small sizes (the default on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: results/...)")
    args = parser.parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpreted:
        print("SKIP: needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on CPU")
        return 0
    device = torch.device("cpu" if interpreted else "cuda")
    small = args.small or device.type == "cpu"
    sizes = SMALL if small else FULL
    rows = kernel_rows(sizes, device) + layer_rows(sizes, device)
    print_table(rows, COLUMNS)
    from support.switchback_selfcheck import failures

    bad = failures(rows)
    print(
        f"\nDISAGREE ({bad.count(chr(10)) + 1} of {len(rows)}):\n{bad}"
        if bad
        else f"\nall {len(rows)} checks agree"
    )
    name = "switchback_diagnose_" + ("interpreter" if interpreted else "gpu")
    _write(rows, args.out or RESULTS_DIR / f"{name}.json", device=device, small=small)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
