"""ZeRO-3's checkpoint state at 64-1024 ranks: rank 0's CPU to build it, today's builder and the old one.

For each world size W, one fresh process is rank 0 of W under torch's fake process group
(collectives return without moving data) and builds the real DeepSpeed ZeRO-3 engine for
ViT-bigG-14 (`bigclip.plan.zero_plan.zero3_engine`: zero.Init partitions every parameter as it is
built, rank 0's partitions are real tensors; the weights' values are not initialised, which no
timing here depends on). Then, timed with `time.process_time` (rank 0's CPU):

  new    the state a save builds: the model and optimizer Statefuls' `state_dict()` (weights,
         two Adam moments, steps, param groups), by bigclip/engines/deepspeed_state.py; best of 3.
         `new_load`: their `load_state_dict()` with that state, as after DCP loaded in place
         (writing back, re-deriving the bf16 compute partitions).
  old    the same `state_dict()` calls through the builder this replaced (copied below as it
         was): a ShardedTensor per entry listing every rank's boxes, validated by torch. Its
         owners table is what its build-time all-gather returned, here from ZeRO-3's rule (that
         all-gather moves no data under the fake group; its own cost is not counted). It grows
         too fast to time in full at large worlds: up to `old_full_up_to` ranks the whole save's
         state is timed, above it only the model state (the weights: one of a save's three passes
         over the parameters) and the save's figure is three times that (`old_save_estimated`);
         above `old_up_to` ranks it is not timed at all.

Also counted: the boxes the entries describe (new: this rank's; old: every rank's).
DCP's own planning and I/O are not in these figures (see docs/scale-and-slurm.md).

    python benchmarks/scale_zero3_state.py [--worlds 64 128 256 512 1024] [--old-full-up-to 256]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the old builder lives in tests/support

from benchmarks.common import env_with_checkout, print_table, write_results  # noqa: E402

WORLDS = [64, 128, 256, 512, 1024]
MODEL_ARGS = ["--model", "ViT-bigG-14", "--batch-size", "2", "--engine", "deepspeed",
              "--deepspeed-config", str(Path(__file__).resolve().parents[1] / "ds_configs/zero3_vit_bigg.json")]  # fmt: skip


def measure(
    worlds: list[int],
    *,
    old_full_up_to: int = 256,
    old_up_to: int | None = None,
    workers: int = 1,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
    timeout_s: float = 6 * 3600,
) -> list[dict[str, Any]]:
    """One row per world size, by world; each measured in a fresh process, `workers` at a time.

    The old builder is timed up to `old_up_to` ranks (None: at every world; 0: never, which
    leaves one ZeRO-3 engine build per world, about a minute each for ViT-bigG-14 on one core):
    for the whole save's state up to `old_full_up_to`, for the weights pass alone above.
    `on_row` gets the rows so far whenever one is done (to keep them if a later one fails)."""

    def old_mode(world: int) -> str:
        if old_up_to is not None and world > old_up_to:
            return "none"
        return "save" if world <= old_full_up_to else "weights"

    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        # The largest worlds first: with the old builder they take longest.
        futures = [
            pool.submit(_run_child, w, old=old_mode(w), timeout_s=timeout_s) for w in sorted(worlds)[::-1]
        ]
        for future in as_completed(futures):
            rows = sorted([*rows, future.result()], key=lambda r: r["world"])
            if on_row is not None:
                on_row(rows)
    return rows


def _run_child(world: int, *, old: str, timeout_s: float) -> dict[str, Any]:
    env = {**env_with_checkout(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, __file__, "--child", str(world), "--old", old]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"world {world} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# -- one world, in its own process ------------------------------------------------------------


def _child(world: int, old: str) -> dict[str, Any]:
    import torch
    from support.zero3_state_reference import old_builder, zero3_owners

    from bigclip.cli_args import parse_train_args
    from bigclip.engines import deepspeed_state
    from bigclip.engines.deepspeed_layout import ZeroLayout
    from bigclip.engines.local_shards import LocalShards
    from bigclip.plan.dryrun import init_fake_group
    from bigclip.plan.zero_plan import zero3_engine

    torch.set_num_threads(1)
    runtime = init_fake_group(world)
    started = time.perf_counter()
    ds_engine = zero3_engine(parse_train_args(MODEL_ARGS), runtime)
    layout = ZeroLayout(ds_engine)
    model = deepspeed_state.DeepSpeedModelState(layout, device=runtime.device)
    inner = ds_engine.optimizer.optimizer
    optim = deepspeed_state.DeepSpeedOptimState(layout, inner, device=runtime.device, fp16=False)
    deepspeed_state.ensure_optimizer_state(inner, layout.flats, layout.flat_groups)  # as after a first step
    build_s = time.perf_counter() - started

    def save_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    new_s, state = min((_cpu(save_state) for _ in range(3)), key=lambda r: r[0])
    new_load_s, _ = _cpu(
        lambda: (model.load_state_dict(state["model"]), optim.load_state_dict(state["optim"]))
    )
    refresh_s, _ = _cpu(layout.refresh_low_precision)  # DeepSpeed's part of a model load
    old_s, old_state = None, {}
    if old != "none":
        with old_builder(zero3_owners(layout, world)):
            old_s, old_state = _cpu(save_state if old == "save" else lambda: {"model": model.state_dict()})
    return {
        "world": world,
        "entries": _count(state, LocalShards, lambda v: 1),
        "boxes_new": _count(state, LocalShards, lambda v: len(v.__create_chunk_list__())),
        "boxes_old": _count(old_state, _sharded_tensor(), lambda v: len(v.metadata().shards_metadata))
        or None,
        "new_save_cpu_s": new_s,
        "new_load_cpu_s": new_load_s,
        "refresh_cpu_s": refresh_s,
        "old_measured": {"save": "whole save", "weights": "weights pass only", "none": None}[old],
        "old_cpu_s": old_s,
        "old_save_cpu_s": None if old_s is None else old_s if old == "save" else 3 * old_s,
        "old_save_estimated": old == "weights",
        "engine_build_s": build_s,
    }


def _cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.process_time()
    out = fn()
    return time.process_time() - started, out


def _count(state: Any, kind: type, per: Callable[[Any], int]) -> int:
    if isinstance(state, dict):
        return sum(_count(v, kind, per) for v in state.values())
    return per(state) if isinstance(state, kind) else 0


def _sharded_tensor() -> type:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor


# -- report -----------------------------------------------------------------------------------


def report(rows: list[dict[str, Any]], *, old_full_up_to: int, final: bool = True) -> None:
    """Ratios against 128 ranks (or the smallest world measured); the table; the JSON."""
    base = next((r for r in rows if r["world"] == 128), rows[0])
    for row in rows:
        row["new_vs_base"] = row["new_save_cpu_s"] / base["new_save_cpu_s"]
        row["old_vs_base"] = _ratio(row["old_save_cpu_s"], base["old_save_cpu_s"])
        row["old_over_new"] = _ratio(row["old_save_cpu_s"], row["new_save_cpu_s"])
    if final:
        columns = ["world", "entries", "boxes_new", "boxes_old", "new_save_cpu_s", "new_load_cpu_s",
                   "old_save_cpu_s", "old_save_estimated", "new_vs_base", "old_vs_base", "old_over_new"]  # fmt: skip
        print_table(rows, columns)
    write_results(
        "scale_zero3_state",
        rows,
        model="ViT-bigG-14",
        config="ds_configs/zero3_vit_bigg.json",
        base_world=base["world"],
        complete=final,
        measured=(
            "rank 0 of W under torch's fake process group with a real DeepSpeed ZeRO-3 engine; CPU seconds "
            "(time.process_time). new_save_cpu_s: the model and optimizer Statefuls' state_dict() (a save's "
            "state: weights, two Adam moments), new builder, best of 3. new_load_cpu_s: their load_state_dict() "
            "with that state, of which refresh_cpu_s is DeepSpeed re-deriving the compute partitions and "
            "re-gathering its persistent parameters. old_save_cpu_s: the same state_dict() by the old builder, "
            f"measured whole up to {old_full_up_to} ranks; above, the weights pass alone (old_cpu_s) times 3 "
            "(old_save_estimated). DCP's planning and I/O are not included."
        ),
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=WORLDS)
    parser.add_argument("--old-full-up-to", type=int, default=256)
    parser.add_argument("--workers", type=int, default=1, help="worlds measured at once (one core each)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--old", choices=["save", "weights", "none"], default="save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.old)), flush=True)
        return
    keep = functools.partial(report, old_full_up_to=args.old_full_up_to, final=False)
    rows = measure(args.worlds, old_full_up_to=args.old_full_up_to, workers=args.workers, on_row=keep)
    report(rows, old_full_up_to=args.old_full_up_to)


if __name__ == "__main__":
    main()
