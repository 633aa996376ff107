"""Loss time on real gloo ranks, communication included: unchunked OpenCLIP local loss vs the
chunked loss (ring and all-gather exchanges).

    python benchmarks/loss_time_gloo.py [--ranks 4] [--locals 256,1024,4096] [--chunk 512]

loss_memory.py times rank 0 alone under the fake process group, where collectives move no
data: its time ratio leaves communication out. Here every rank is a real process and every
byte crosses gloo (loopback TCP), as on a CPU cluster. fp32 features of ViT-bigG-14's width
(1280), CLIP loss, forward + backward; per method the slowest rank's time of a round, best of
--repeats rounds, methods interleaved; one intra-op thread per rank. On the 2-core box 4 ranks
share 2 cores: compute and communication both queue for them, so the ratios are this box's,
not a cluster's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import print_table, write_results  # noqa: E402

from bigclip.distributed import spawn  # noqa: E402
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss, ClipLoss  # noqa: E402

DIM = 1280
METHODS = ("unchunked", "ring", "allgather")


def build(method: str, chunk: int) -> torch.nn.Module:
    if method == "unchunked":
        return ClipLoss(local_loss=True, gather_with_grad=True)
    return ChunkedContrastiveLoss(kind="clip", chunk_size=chunk, exchange=method)


def worker(rank: int, world: int, local: int, chunk: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(rank)
    image = F.normalize(torch.randn(local, DIM, generator=g), dim=-1).requires_grad_()
    text = F.normalize(torch.randn(local, DIM, generator=g), dim=-1).requires_grad_()
    scale = torch.tensor(1 / 0.07, requires_grad=True)
    losses = {m: build(m, chunk) for m in METHODS}
    best = dict.fromkeys(METHODS, math.inf)
    for _ in range(repeats):
        for method, loss_fn in losses.items():
            dist.barrier()
            start = time.perf_counter()
            loss_fn(image, text, scale).backward()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a round lasts as long as its slowest rank
            best[method] = min(best[method], elapsed.item())
            image.grad = text.grad = scale.grad = None
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--locals", default="256,1024,4096", help="local batch sizes")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for local in (int(x) for x in args.locals.split(",")):
        secs = spawn(worker, args.ranks, local, args.chunk, args.repeats)[0]
        for method in METHODS:
            row = {"ranks": args.ranks, "global": args.ranks * local, "local": local, "method": method}
            rows.append(row | {"seconds": secs[method], "time_ratio": secs[method] / secs["unchunked"]})
        print_table(rows[-len(METHODS) :])
    print_table(rows)
    write_results(
        "loss_time_gloo",
        rows,
        embed_dim=DIM,
        loss="clip",
        dtype="float32",
        chunk=args.chunk,
        timing=f"slowest rank per round, best of {args.repeats}, methods interleaved, 1 thread per rank",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
