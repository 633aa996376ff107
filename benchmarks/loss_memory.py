"""Loss memory and time of rank 0 of 16: unchunked OpenCLIP local loss vs the chunked loss.

    PYTHONPATH=. python benchmarks/loss_memory.py            # the full table (~10-15 min on CPU)
    PYTHONPATH=. python benchmarks/loss_memory.py --quick    # small sizes, a smoke run

Setting: CLIP loss, embed dim 1280 (ViT-bigG-14), 16 data-parallel ranks, local batch 512, 2,048
and 4,096 (global 8,192, 32,768 and 65,536), fp32 features. Methods: `unchunked` is OpenCLIP's
--local-loss --gather-with-grad (bigclip's ClipLoss), `ring` and `allgather` the chunked loss
with each exchange.

Sixteen real ranks at these sizes do not fit this box, so rank 0 runs alone under torch's fake
process group (collectives allocate their outputs, move no data; point-to-point ops are no-ops
that leave receive buffers as allocated). Each (method, size) runs in a fresh subprocess.

Memory: on CPU, the peak of live tensor bytes allocated during forward + backward, measured with
torch's MemTracker (a TorchDispatchMode that registers every storage an ATen op returns and drops
it when the storage is freed), minus the input features, which exist either way. It counts
exchanged and gathered features, receive buffers, logits, saved tensors and the input
gradients; scratch memory private to a kernel (BLAS, softmax internals) is invisible to it, for
every method alike. On CUDA: torch.cuda.max_memory_allocated above the pre-loss baseline.
Time: one untracked forward + backward after the tracked run (which doubles as warm-up).
The same run checks the fake group against 4 real gloo ranks at the smallest local batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import print_table, write_results  # benchmarks/ is the script's directory

from bigclip.distributed import spawn
from bigclip.ops.contrastive import ChunkedContrastiveLoss, ClipLoss

METHODS = ("unchunked", "ring", "allgather")
DIM = 1280
WORLD = 16
MiB = 2**20


def build(method: str, chunk: int) -> torch.nn.Module:
    if method == "unchunked":
        return ClipLoss(local_loss=True, gather_with_grad=True)
    return ChunkedContrastiveLoss(kind="clip", chunk_size=chunk, exchange=method)


def make_inputs(local: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(local, DIM, generator=g), dim=-1).to(device).requires_grad_()
    text = F.normalize(torch.randn(local, DIM, generator=g), dim=-1).to(device).requires_grad_()
    return image, text, torch.tensor(1 / 0.07, device=device, requires_grad=True)


def forward_backward(loss_fn: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    loss_fn(*inputs).backward()
    for t in inputs:
        t.grad = None


def peak_loss_bytes(loss_fn: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """Peak bytes allocated by one forward + backward beyond the inputs (see the docstring)."""
    if inputs[0].is_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward(loss_fn, inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*inputs)
    with tracker:
        forward_backward(loss_fn, inputs)
    peak = tracker.get_tracker_snapshot("peak")[inputs[0].device]["Total"]
    return peak - sum(t.untyped_storage().nbytes() for t in inputs)


def seconds(loss_fn: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> float:
    if inputs[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    forward_backward(loss_fn, inputs)
    if inputs[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(method: str, local: int, chunk: int, *, timed: bool = True) -> dict[str, Any]:
    """Memory (and time) of rank 0 under the current process group."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    inputs = make_inputs(local, device)
    loss_fn = build(method, chunk)
    row = {"peak_MiB": peak_loss_bytes(loss_fn, inputs) / MiB}
    if timed:
        row["seconds"] = seconds(loss_fn, inputs)
    return row


def fake_worker(method: str, world: int, local: int, chunk: int, timed: bool) -> dict[str, Any]:
    """Rank 0 of `world` under the fake process group, in this (fresh) process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_flush_denormal(True)  # receive buffers are never written under the fake group
    # One intra-op thread, as each rank of bigclip.distributed.spawn: on this shared 2-core box a
    # second OpenMP thread makes every small tile op wait for a descheduled peer.
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return measure(method, local, chunk, timed=timed)
    finally:
        dist.destroy_process_group()


def run_fake(method: str, world: int, local: int, chunk: int, *, timed: bool = True) -> dict[str, Any]:
    """fake_worker in a fresh interpreter, so each configuration starts from empty memory."""
    spec = json.dumps({"method": method, "world": world, "local": local, "chunk": chunk, "timed": timed})
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", spec], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def real_worker(rank: int, world: int, local: int, chunk: int) -> dict[str, float]:
    return {m: measure(m, local, chunk, timed=False)["peak_MiB"] for m in METHODS}


def fake_vs_real(local: int, chunk: int, world: int = 4) -> list[dict[str, Any]]:
    real = spawn(real_worker, world, local, chunk)[0]
    rows = []
    for method in METHODS:
        fake = run_fake(method, world, local, chunk, timed=False)["peak_MiB"]
        rows.append(
            {
                "method": method,
                "ranks": world,
                "local": local,
                "real_gloo_MiB": real[method],
                "fake_pg_MiB": fake,
                "fake/real": fake / real[method],
            }
        )
    return rows


def size_rows(local: int, chunk: int) -> list[dict[str, Any]]:
    results = {m: run_fake(m, WORLD, local, chunk) for m in METHODS}
    base = results["unchunked"]
    rows = []
    for method, r in results.items():
        rows.append(
            {
                "global": WORLD * local,
                "local": local,
                "method": method,
                "chunk": 0 if method == "unchunked" else chunk,
                "peak_MiB": r["peak_MiB"],
                "seconds": r["seconds"],
                "mem_saving_x": base["peak_MiB"] / r["peak_MiB"],
                "time_ratio": r["seconds"] / base["seconds"],
            }
        )
        print(f"  global {WORLD * local}: {method} {r['peak_MiB']:.1f} MiB, {r['seconds']:.2f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--locals", default="512,2048,4096", help="local batch sizes (x16 ranks)")
    parser.add_argument("--chunk", type=int, default=512, help="--loss-chunk-size of the chunked loss")
    parser.add_argument("--quick", action="store_true", help="local batches 64,256: a smoke run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(fake_worker(**json.loads(args.worker))))
        return 0
    locals_ = [64, 256] if args.quick else [int(x) for x in args.locals.split(",")]
    check = fake_vs_real(locals_[0], args.chunk)
    print_table(check)
    rows = [row for local in locals_ for row in size_rows(local, args.chunk)]
    print_table(rows)
    write_results(
        "loss_memory" + ("_quick" if args.quick else ""),
        rows,
        embed_dim=DIM,
        world_size=WORLD,
        loss="clip",
        dtype="float32",
        memory_method=(
            "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "MemTracker live tensor bytes"
        ),
        fake_vs_real=check,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
