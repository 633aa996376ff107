"""What a 1024-rank ViT-bigG-14 run costs each rank, by simulation at 64-1024 ranks (issue 37's
goals 1-6), side by side with the code it replaced where that code still exists. Writes
benchmarks/results/scale_sim.json; docs/scale-and-slurm.md renders its table.

    python benchmarks/scale_sim.py [--worlds 64 128 256 512 1024] [--goals 1 2 3 4 5 6]

Each goal is its own benchmark's `measure` (run alone for more detail and columns):
  1 ZeRO-3 state   benchmarks/scale_zero3_state.py: rank 0 of W under torch's fake process group
                   builds the real DeepSpeed ZeRO-3 engine of ViT-bigG-14, then its checkpoint
                   state (CPU seconds), beside the builder it replaced (up to --old-up-to ranks).
  2 DCP commit     benchmarks/scale_dcp.py: every rank's DCP metadata from the shapes and DCP's own
                   planner, rank 0's work per save (first and later) beside DCP's coordinator
                   (up to --today-up-to ranks), `.metadata`'s size, what a rank reads to resume.
  3 S3 requests    the planner's count at W (bigclip/plan/checkpoint_cost.py, from the writer's own
                   rules): writes per save on each rank's prefix and on the step folder, beside the
                   layout before (4 objects a rank, 8 MiB parts, all in the step folder). The
                   throttled saves themselves run for real at 10 ranks (tests/test_s3_request_rate.py).
  4 epoch start    the shard opens of an epoch's first second, from the readers' own schedule
                   (bigclip/data/open_schedule.py), beside every reader opening at once; credential
                   look-ups are one per worker per run (persistent workers), counted for real at
                   2 ranks x 8 workers by tests/test_data_epoch_start.py.
  5 hang           benchmarks/scale_store.py: W ranks' real watchdogs on one real TCPStore, a node
                   killed: survivors named and requeued, store requests per rank, beside the old
                   roll call (up to --old-up-to ranks; `python benchmarks/scale_store.py` runs it
                   at every world).
  6 sockets        benchmarks/scale_sockets.py: sockets per process of real 4-32 rank worlds,
                   lazily connected and full mesh, fitted out to W.
Counts are exact; seconds are the running machine's, shared by every simulated rank: an upper
bound for a cluster where each rank has cores of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.data.open_schedule import OPEN_RATE, open_delays  # noqa: E402
from bigclip.storage.save_requests import upload_requests  # noqa: E402

WORLDS = [64, 128, 256, 512, 1024]
BIGG_PLAN = ["--model", "ViT-bigG-14", "--precision", "amp_bf16", "--local-loss", "--gather-with-grad",
             "--loss-chunk-size", "1024", "--batch-size", "160"]  # fmt: skip
OLD_OBJECTS_PER_RANK, OLD_PART_BYTES, OLD_STEP_EXTRA = 4, 8 << 20, 4  # the layout before issue 37
READERS, INTERLEAVE = 8, 4  # data workers per rank and shards each opens at once (--shard-interleave)


def goal_zero3(worlds: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks import scale_zero3_state

    rows = scale_zero3_state.measure(
        worlds, old_full_up_to=args.old_up_to, old_up_to=args.old_up_to, workers=2
    )
    base = next((r for r in rows if r["world"] == min(worlds)), rows[0])
    return [
        {
            "world": r["world"],
            "rank 0 CPU s per save": r["new_save_cpu_s"],
            "vs smallest world": r["new_save_cpu_s"] / base["new_save_cpu_s"],
            "old builder CPU s": r.get("old_save_cpu_s"),
            "old estimated": r.get("old_save_estimated"),
            "load CPU s": r["new_load_cpu_s"],
            "boxes": r["boxes_new"],
            "boxes old": r["boxes_old"],
        }  # fmt: skip
        for r in rows
    ]


def goal_dcp(worlds: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks import scale_dcp

    return scale_dcp.measure(worlds, today_up_to=args.today_up_to)


def _plan(world: int) -> dict[str, Any]:
    from bigclip.plan.command import main as plan_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_main(["--gpus", str(world), *BIGG_PLAN, "--json"])
    return json.loads(out.getvalue())


def goal_s3(worlds: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for world in worlds:
        plan = _plan(world)
        cost = plan["checkpoint_coordination"]
        rank_bytes = math.ceil(plan["checkpoint_total_bytes"] / world)
        old_rank = OLD_OBJECTS_PER_RANK * upload_requests(
            math.ceil(rank_bytes / OLD_OBJECTS_PER_RANK), part_bytes=OLD_PART_BYTES
        )
        old_folder = world * old_rank + upload_requests(cost["metadata_bytes"], part_bytes=OLD_PART_BYTES)
        rows.append({
            "world": world, "writes per rank prefix": cost["rank_prefix_writes"],
            "writes on the step folder": cost["step_folder_writes"], "writes per save": plan["s3_requests_per_save"],
            "old: writes on the step folder": old_folder + OLD_STEP_EXTRA,
            "busiest prefix vs old": cost["step_folder_writes"] / (old_folder + OLD_STEP_EXTRA),
        })  # fmt: skip
    return rows


def goal_epoch_start(worlds: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for world in worlds:
        starts = [
            delay
            for rank in range(world)
            for delay in open_delays(
                rank=rank, world_size=world, readers=READERS, interleave=INTERLEAVE, rate=OPEN_RATE
            )
        ]
        per_second: dict[int, int] = {}
        for delay in starts:  # each reader opens INTERLEAVE shards at its start
            per_second[int(delay)] = per_second.get(int(delay), 0) + INTERLEAVE
        rows.append({
            "world": world, "first opens": len(starts) * INTERLEAVE,
            "most opens in one second": max(per_second.values()), "old: opens in the first second": len(starts) * INTERLEAVE,
            "seconds to open all": max(starts) + 1 / OPEN_RATE if starts else 0.0,
            "credential look-ups per run": world * READERS, "old: look-ups per epoch": world * READERS,
        })  # fmt: skip
    return rows


def goal_hang(worlds: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks import scale_store

    rows = []
    for world in worlds:  # the old roll call up to --old-up-to: scale_store.py's own run goes to 1024
        rows += scale_store.measure(
            [world], protocols=("new", "old") if world <= args.old_up_to else ("new",)
        )
    return rows


def goal_sockets(worlds: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks import scale_sockets

    rows = scale_sockets.measure()
    return [r for r in rows if r["world"] in worlds or r["measured or fit"] == "measured"]


GOALS: dict[int, tuple[str, Callable[[list[int], argparse.Namespace], list[dict[str, Any]]]]] = {
    1: ("ZeRO-3 checkpoint state", goal_zero3),
    2: ("DCP commit and resume reads", goal_dcp),
    3: ("S3 writes per prefix per save", goal_s3),
    4: ("epoch start", goal_epoch_start),
    5: ("a lost node's roll call", goal_hang),
    6: ("sockets per process", goal_sockets),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=WORLDS)
    parser.add_argument("--goals", type=int, nargs="+", default=list(GOALS), choices=list(GOALS))
    parser.add_argument(
        "--old-up-to",
        type=int,
        default=256,
        help="goals 1 and 5: run the old ZeRO-3 state builder and the old roll call up to this world",
    )
    parser.add_argument(
        "--today-up-to", type=int, default=128, help="goal 2: time DCP's coordinator up to this world"
    )
    args = parser.parse_args()
    goals, seconds = {}, {}
    for number in args.goals:
        name, measure = GOALS[number]
        print(f"== goal {number}: {name}", flush=True)
        started = time.monotonic()
        rows = measure(args.worlds, args)
        seconds[str(number)] = round(time.monotonic() - started, 1)
        print_table(rows)
        goals[str(number)] = {"name": name, "rows": rows}
    flat = [{"goal": int(n), **row} for n, g in goals.items() for row in g["rows"]]
    write_results("scale_sim", flat, goals=goals, seconds=seconds, worlds=args.worlds,
                  old_up_to=args.old_up_to, today_up_to=args.today_up_to)  # fmt: skip
    print(f"seconds per goal: {seconds}; in all {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main()
