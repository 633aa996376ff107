"""bigclip's chunked CLIP loss vs Inf-CL's ring loss on one GPU: peak memory, time, agreement.

    python benchmarks/loss_infcl_gpu.py [--quick] [--globals 65536,262144] [--chunks 4096,8192]

Global batch 64k and 256k on one GPU (a world of one), ViT-bigG-14's embed dim 1280, fp32
L2-normalised features, logit scale 1/0.07 (a learnable scalar). Inf-CL (`pip install inf-cl`,
github.com/DAMO-NLP-SG/Inf-CLIP) computes one direction per call, `cal_inf_loss(q, k, scale=s)`,
its Triton kernels in fp32 with head_dim 256; CLIP's symmetric loss is the mean of both
directions, as Inf-CLIP trains. Its scale gradient is all-reduced, so a one-rank NCCL group is
initialised for both methods. Memory: torch.cuda.max_memory_allocated of one forward+backward
above the inputs; time: best of --repeats, methods interleaved. Agreement: the loss and each
gradient of Inf-CL vs bigclip, as max |difference| / max |bigclip value|.
Floors (issue 16): peak memory <= 1.0x Inf-CL, time <= 1.2x, gradients agreeing.
Writes results/loss_infcl_gpu.json; skipped (exit 0, "SKIP: ...") without CUDA or inf_cl.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import missing_package, print_table, write_gpu_results  # noqa: E402

from bigclip.distributed import free_port  # noqa: E402
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss  # noqa: E402

DIM = 1280
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # loss, d image, d text, d scale


def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    image = F.normalize(torch.randn(n, DIM, device="cuda", generator=g), dim=-1)
    text = F.normalize(image + 0.8 * torch.randn(n, DIM, device="cuda", generator=g), dim=-1)
    return image, text, torch.tensor(math.log(1 / 0.07), device="cuda")


def infcl_loss() -> Callable:
    from inf_cl import cal_inf_loss

    def loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return 0.5 * (cal_inf_loss(image, text, scale=scale) + cal_inf_loss(text, image, scale=scale))

    return loss


def bigclip_loss(chunk: int) -> Callable:
    fn = ChunkedContrastiveLoss(kind="clip", chunk_size=chunk)
    return lambda image, text, scale: fn(image, text, scale)


def run(loss: Callable, image: torch.Tensor, text: torch.Tensor, log_scale: torch.Tensor) -> Grads:
    leaves = [t.detach().clone().requires_grad_() for t in (image, text, log_scale)]
    value = loss(leaves[0], leaves[1], leaves[2].exp())
    value.backward()
    return (value.detach(), *(t.grad for t in leaves))


def peak_and_result(loss: Callable, data: tuple) -> tuple[float, Grads]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = run(loss, *data)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20, result


def best_seconds(losses: dict[str, Callable], data: tuple, repeats: int) -> dict[str, float]:
    best = dict.fromkeys(losses, math.inf)
    for _ in range(repeats):
        for name, loss in losses.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            run(loss, *data)
            torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def disagreement(got: Grads, want: Grads) -> dict[str, float]:
    names = ("loss", "d_image", "d_text", "d_scale")
    return {
        f"{n}_rel_diff": (
            (g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)
        ).item()
        for n, g, w in zip(names, got, want)
    }


def rows_for(n: int, chunks: list[int], repeats: int) -> list[dict]:
    data = inputs(n)
    losses = {"inf-cl": infcl_loss(), **{f"bigclip chunk {c}": bigclip_loss(c) for c in chunks}}
    measured = {name: peak_and_result(loss, data) for name, loss in losses.items()}
    seconds = best_seconds(losses, data, repeats)
    ref_mib, ref = measured["inf-cl"]
    rows = []
    for name, (mib, result) in measured.items():
        row = {"global": n, "method": name, "peak_MiB": mib, "seconds": seconds[name]}
        row |= {"memory_vs_infcl": mib / ref_mib, "time_vs_infcl": seconds[name] / seconds["inf-cl"]}
        rows.append(
            row | ({} if name == "inf-cl" else disagreement(ref, result)) | {"loss": result[0].item()}
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="global 65,536 and chunk 4096 only")
    parser.add_argument("--globals", default="65536,262144")
    parser.add_argument("--chunks", default="4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    reason = "needs a CUDA GPU" if not torch.cuda.is_available() else missing_package("inf_cl", "triton")
    if reason:
        print(f"SKIP: {reason}")
        return 0
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    sizes = [65536] if args.quick else [int(x) for x in args.globals.split(",")]
    chunks = [4096] if args.quick else [int(x) for x in args.chunks.split(",")]
    rows = [row for n in sizes for row in rows_for(n, chunks, args.repeats)]
    print_table(rows)
    write_gpu_results("loss_infcl", rows, embed_dim=DIM, dtype="float32", world_size=1, quick=args.quick)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
