"""Host overhead of a training step, measured on a CPU: ViT-bigG-14 at its full depth (48 image and
32 text blocks, every parameter tensor it has) and a tiny width, so a step's time is the host's
(Python, operator dispatch, FSDP2's hooks, the optimizer's loops), not arithmetic. On a GPU that
time is what the step leaves the device idle for when it is not hidden behind kernels.

Rows, each in a process of its own, on one thread: bigclip's step as the GPU benchmarks run it
(the FSDP engine at a world of one, amp_bf16, selective checkpointing, eager and with compiled
blocks), and the same rows for a baseline commit of bigclip (`--baseline`, by default the last
commit before the levers, run from a git worktree of it); FSDP2 at a world of one, which the
engine ran there before it kept fp32 masters instead, with its best settings; OpenCLIP's own
step at the same shape (its CLIP, autocast bf16, full checkpointing, ClipLoss, AdamW) in the
same torch.
Columns: host ms per step (the best step over `--rounds` runs of every row, which alternate with
their baseline's, so drifting load hits both alike), aten operators dispatched per step (eager
rows: compiled blocks run inside inductor's code), and each to the baseline's row of the same kind.

    python benchmarks/host_overhead.py [--steps 9] [--rounds 3] [--baseline REV]

Prints a table and writes benchmarks/results/host_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "af1e55c"  # main before the grad norm went multi-tensor
SHAPE = {  # ViT-bigG-14's depth, OpenCLIP's schema; widths cut so arithmetic is negligible
    "embed_dim": 32,
    "vision_cfg": {"image_size": 28, "layers": 48, "width": 32, "head_width": 16, "mlp_ratio": 4.9231,
                   "patch_size": 14},
    "text_cfg": {"context_length": 8, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 32},
}  # fmt: skip
BATCH = 2
# name -> (which step, its options): --torchcompile; `fsdp2`: FSDP2 even at a world of one, with
# --reshard-after-forward and --fsdp-blocks-per-unit (the baseline commit always runs FSDP2).
FSDP2_BEST = {"fsdp2": True, "reshard": False, "per_unit": 16}
ROWS = {
    "bigclip": ("bigclip", {"compile": False}),
    "bigclip compiled": ("bigclip", {"compile": True}),
    "FSDP2": ("bigclip", {"compile": False, "fsdp2": True}),
    "FSDP2, 16 blocks a unit, no reshard": ("bigclip", {"compile": False, **FSDP2_BEST}),
    "FSDP2 compiled, 16 blocks a unit, no reshard": ("bigclip", {"compile": True, **FSDP2_BEST}),
    "OpenCLIP": ("openclip", {}),
}


def count_ops(step: Any) -> int:
    """aten operators one call of `step` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.n[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as counted:
        step()
    return sum(counted.n.values())


def timed(step: Any, steps: int, *, ops: bool) -> dict[str, Any]:
    for _ in range(3):  # warm-up: optimizer state, compiled graphs, allocator
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    # The best of the steps: host time only grows with interference (other processes, the
    # allocator), so the minimum is the step's own cost; the median is kept beside it.
    return {
        "host_ms": min(times) * 1e3,
        "median_ms": statistics.median(times) * 1e3,
        "aten_ops": count_ops(step) if ops else None,
    }


def bigclip_config(options: dict[str, Any]) -> Any:
    """The run's config for a bigclip row, and its model on the meta device."""
    import torch

    from bigclip.config import TrainConfig
    from bigclip.models.clip import CLIP
    from bigclip.models.named_configs import get_model_config

    torch.set_num_threads(1)
    cfg = TrainConfig()
    cfg.engine.precision = "amp_bf16"
    cfg.engine.reshard_after_forward = options.get("reshard", True)
    cfg.model.grad_checkpointing, cfg.model.grad_checkpointing_policy = True, "ops"
    cfg.model.torchcompile = options["compile"]
    if options.get("per_unit", 1) != 1:  # (a baseline commit may predate the option)
        cfg.engine.fsdp_blocks_per_unit = options["per_unit"]
    cfg.optim.lr, cfg.optim.warmup = 1e-4, 0
    cfg.validate()
    model_cfg = get_model_config("ViT-bigG-14")
    for part, values in SHAPE.items():
        for key, value in values.items() if isinstance(values, dict) else ():
            setattr(getattr(model_cfg, part), key, value)
    model_cfg.embed_dim = SHAPE["embed_dim"]
    model = CLIP(model_cfg, device="meta")
    model.set_grad_checkpointing(True, policy="ops")
    return cfg, model


def bigclip_worker(rank: int, world: int, options: dict[str, Any], steps: int) -> dict[str, Any]:
    import torch

    from bigclip.distributed import Runtime
    from bigclip.engines import build_engine
    from bigclip.ops.loss.contrastive import build_loss
    from bigclip.train.trainer import contrastive_loss

    cfg, model = bigclip_config(options)
    engine = build_engine(cfg, Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    if options.get("fsdp2"):  # (a baseline's engine has no such attribute: it is FSDP2 anyway)
        engine.world_of_one = False
    engine.build(model)
    loss_fn = build_loss(cfg.loss)
    images, texts = batch()

    def step() -> None:
        engine.backward(contrastive_loss(loss_fn, engine.forward(images, texts)))
        engine.step(lr=1e-4)

    return timed(step, steps, ops=not options["compile"])


def openclip_step(steps: int) -> dict[str, Any]:
    import importlib

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from support.openclip_ref import open_clip_model_module

    torch.set_num_threads(1)
    model = open_clip_model_module().CLIP(**SHAPE)
    model.set_grad_checkpointing(True)
    loss_fn = importlib.import_module("open_clip.loss").ClipLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # OpenCLIP's trainer: foreach AdamW
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import openclip_train_step

    return timed(openclip_train_step(model, loss_fn, optimizer, *batch()), steps, ops=True)


def batch() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    size, context = SHAPE["vision_cfg"]["image_size"], SHAPE["text_cfg"]["context_length"]
    images = torch.randn(BATCH, 3, size, size, generator=g)
    texts = torch.randint(1, 49000, (BATCH, context), generator=g)
    texts[:, -1] = 49407  # end of text, where the text tower pools
    return images, texts


def measure_row(name: str, steps: int) -> dict[str, Any]:
    """In this process: one row (the bigclip rows on a gloo world of one, as a run has)."""
    kind, options = ROWS[name]
    if kind == "openclip":
        return openclip_step(steps)
    from bigclip.distributed import spawn

    return spawn(bigclip_worker, 1, options, steps)[0]


def run_row(name: str, steps: int, *, tree: Path) -> dict[str, Any]:
    """A row in a fresh process whose `bigclip` is `tree`'s (this checkout, or the baseline's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, __file__, "--row", name, "--steps", str(steps)],
        env=env, cwd=tree, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"row {name!r} from {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=9, help="timed steps per row (the best is reported)")
    parser.add_argument("--rounds", type=int, default=3, help="times every row runs (the best is reported)")
    parser.add_argument("--baseline", default=BASELINE, help="the commit whose rows are the 1.00x")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure one row, print JSON
    args = parser.parse_args()
    if args.row:
        print(json.dumps(measure_row(args.row, args.steps)))
        return

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import print_table, write_results

    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(old), args.baseline], cwd=ROOT, check=True
        )
        try:
            measured: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for _ in range(args.rounds):  # every row once a round, each beside its baseline
                for name, (kind, options) in ROWS.items():
                    paired = kind == "bigclip" and not options.get("fsdp2")  # the baseline has these rows
                    for code, tree in [("this tree", ROOT)] + ([(args.baseline, old)] if paired else []):
                        measured.setdefault((name, code), []).append(run_row(name, args.steps, tree=tree))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    rows = [
        {"row": name, "code": code, "host_ms": min(r["host_ms"] for r in runs),
         "median_ms": statistics.median(r["median_ms"] for r in runs), "aten_ops": runs[0]["aten_ops"]}
        for (name, code), runs in measured.items()
    ]  # fmt: skip
    base = {r["row"]: r for r in rows if r["code"] == args.baseline}
    today = {compiled: base["bigclip compiled" if compiled else "bigclip"] for compiled in (False, True)}
    for row in rows:
        ref = today["compiled" in row["row"]]
        row["host_vs_baseline"] = row["host_ms"] / ref["host_ms"]
        row["ops_vs_baseline"] = (
            row["aten_ops"] / ref["aten_ops"] if row["aten_ops"] and ref["aten_ops"] else None
        )
    print_table(rows, ["row", "code", "host_ms", "aten_ops", "host_vs_baseline", "ops_vs_baseline"])
    write_results(
        "host_overhead", rows, baseline=args.baseline, shape=SHAPE, batch=BATCH, steps=args.steps,
        rounds=args.rounds,
        note="one thread; host_ms: the best step of any round; ratios to the baseline commit's bigclip row "
        "of the same kind (eager or compiled)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
