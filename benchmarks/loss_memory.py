"""Loss memory and time of rank 0 of 16: unchunked OpenCLIP local loss vs the chunked loss.

    python benchmarks/loss_memory.py            # the full table (~10-15 min on CPU)
    python benchmarks/loss_memory.py --quick    # small sizes, a smoke run

Setting: CLIP loss, embed dim 1280 (ViT-bigG-14), 16 data-parallel ranks, local batch 512, 2,048
and 4,096 (global 8,192, 32,768 and 65,536), fp32 features. Methods: `unchunked` is OpenCLIP's
--local-loss --gather-with-grad (bigclip's ClipLoss), `ring` and `allgather` the chunked loss
with each exchange.

Sixteen real ranks at these sizes do not fit this box, so rank 0 runs alone under torch's fake
process group (collectives allocate their outputs, move no data; point-to-point ops are no-ops
that leave receive buffers as allocated). Each (method, size) runs in a fresh subprocess.

Memory: on CPU, the peak of live tensor bytes allocated during forward + backward, measured by
LiveTensorBytes (a TorchDispatchMode that registers every storage an ATen op returns and drops
it when the storage is freed), inputs excluded as they exist either way. It counts
exchanged and gathered features, receive buffers, logits, saved tensors and the input
gradients; scratch memory private to a kernel (BLAS, softmax internals) is invisible to it, for
every method alike. On CUDA: torch.cuda.max_memory_allocated above the pre-loss baseline.
Time: untracked forward + backward in one process per size, methods interleaved, best of 3 runs
(2 at local 4,096), one intra-op thread (as each spawned rank). The box is shared: expect +-30%.
The same run checks the fake group against 4 real gloo ranks at the smallest local batch. They
agree exactly for `unchunked` and `ring`; for `allgather` real gloo is higher because gloo's
reduce-scatter copies its whole input internally (NCCL's does not; the fake group allocates
nothing there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # runs as `python benchmarks/loss_memory.py`

from common import gpu_info, print_table, write_results  # noqa: E402

from bigclip.distributed import spawn  # noqa: E402
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss, ClipLoss  # noqa: E402

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


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that ATen ops return inside the region, while alive.

    Each storage counts from the first op that returns it until it is freed (weakref.finalize
    on the storage). Storages registered in `exclude` (the inputs) are never counted. Unlike
    torch's MemTracker this installs no autograd hooks, which would keep gradients referenced
    and make AccumulateGrad copy them (a copy training never makes).
    """

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self._seen: set[int] = {id(t.untyped_storage()) for t in exclude}
        self._keep = [t.untyped_storage() for t in exclude]  # so their ids stay theirs
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        self.peak = max(self.peak, self.current)
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._seen:
            return
        self._seen.add(key)
        self.current += storage.nbytes()
        weakref.finalize(storage, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes


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
    with LiveTensorBytes(exclude=inputs) as tracker:
        forward_backward(loss_fn, inputs)
    return tracker.peak


def seconds(loss_fn: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> float:
    if inputs[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    forward_backward(loss_fn, inputs)
    if inputs[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def device(kind: str = "") -> torch.device:
    """`kind` ('cpu' / 'cuda'), else CUDA when present."""
    if kind == "cpu" or not (kind or torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def memory_mib(method: str, local: int, chunk: int, kind: str = "") -> float:
    """Peak loss memory of rank 0 under the current process group."""
    return peak_loss_bytes(build(method, chunk), make_inputs(local, device(kind))) / MiB


def best_seconds(local: int, chunk: int, repeats: int) -> dict[str, float]:
    """Fastest of `repeats` runs per method, interleaved so load drift on a shared box hits all."""
    inputs = make_inputs(local, device())
    losses = {m: build(m, chunk) for m in METHODS}
    best = dict.fromkeys(METHODS, math.inf)
    for _ in range(repeats):
        for method, loss_fn in losses.items():
            best[method] = min(best[method], seconds(loss_fn, inputs))
    return best


def fake_worker(
    mode: str, world: int, local: int, chunk: int, method: str = "", repeats: int = 1, kind: str = ""
) -> dict:
    """Rank 0 of `world` under the fake process group, in this (fresh) process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_flush_denormal(True)  # receive buffers are never written under the fake group
    # One intra-op thread, as each rank of bigclip.distributed.spawn: on this shared 2-core box a
    # second OpenMP thread makes every small tile op wait for a descheduled peer.
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        if mode == "memory":
            return {"peak_MiB": memory_mib(method, local, chunk, kind)}
        return best_seconds(local, chunk, repeats)
    finally:
        dist.destroy_process_group()


def run_fake(**spec: Any) -> dict[str, Any]:
    """fake_worker in a fresh interpreter, so each measurement starts from empty memory."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def real_worker(rank: int, world: int, local: int, chunk: int) -> dict[str, float]:
    # gloo moves CPU tensors: the fake-vs-real check runs on CPU on a GPU machine too.
    return {m: memory_mib(m, local, chunk, "cpu") for m in METHODS}


def fake_vs_real(local: int, chunk: int, world: int = 4) -> list[dict[str, Any]]:
    real = spawn(real_worker, world, local, chunk)[0]
    rows = []
    for method in METHODS:
        spec = {"method": method, "world": world, "local": local, "chunk": chunk, "kind": "cpu"}
        fake = run_fake(mode="memory", **spec)["peak_MiB"]
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
    spec = {"world": WORLD, "local": local, "chunk": chunk}
    peaks = {m: run_fake(mode="memory", method=m, **spec)["peak_MiB"] for m in METHODS}
    print(f"  global {WORLD * local} peak MiB: {peaks}", flush=True)
    secs = run_fake(mode="time", repeats=3 if local <= 2048 else 2, **spec)
    print(f"  global {WORLD * local} seconds: {secs}", flush=True)
    return [
        {
            "global": WORLD * local,
            "local": local,
            "method": method,
            "chunk": 0 if method == "unchunked" else chunk,
            "peak_MiB": peaks[method],
            "seconds": secs[method],
            "mem_saving_x": peaks["unchunked"] / peaks[method],
            "time_ratio": secs[method] / secs["unchunked"],
        }
        for method in METHODS
    ]


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
    gpu = gpu_info() if torch.cuda.is_available() else {}
    write_results(
        "loss_memory" + ("_quick" if args.quick else "") + ("_gpu" if gpu else ""),
        rows,
        embed_dim=DIM,
        world_size=WORLD,
        loss="clip",
        dtype="float32",
        memory_method=(
            "torch.cuda.max_memory_allocated"
            if torch.cuda.is_available()
            else "LiveTensorBytes: peak live tensor storage bytes (TorchDispatchMode)"
        ),
        timing="best of 3 runs (2 at local 4096), methods interleaved, 1 intra-op thread per measurement",
        fake_vs_real=check,
        **gpu,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
