"""Resume with and without the integrity checks: what verifying every byte as it streams costs.

One run, one checkpoint (default 1.5 GiB: fp32 weights plus two Adam moments, in 32 MiB
tensors), loaded into the preallocated state side by side, rounds alternating which goes first:

  verified   CheckpointStore.load: the manifest's size check, `.metadata` against its SHA-256,
             every chunk's CRC-32s and a NaN/inf test per tensor (verified_reader.py)
  unchecked  the same load through DCP's stock reader (sizes only: what resume did before)

The checkpoint is on local disk and read warm from the page cache, so the checks' CPU cost is
measured against the fastest read there is (on S3 or a cold disk, I/O hides more of it).

    python benchmarks/resume_integrity.py [--gib 1.5] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.checkpoint import CheckpointStore, lookup  # noqa: E402
from bigclip.checkpoint.safe_load import SafeLoadPlanner  # noqa: E402

TENSOR_ELEMENTS = 8 << 20  # 32 MiB of fp32


def make_state(total_bytes: int, *, fill: float | None = None) -> dict:
    """Weights and two moments per weight, `total_bytes` in all (random, or `fill`)."""
    count = max(1, round(total_bytes / (3 * TENSOR_ELEMENTS * 4)))
    g = torch.Generator().manual_seed(0)

    def tensor() -> torch.Tensor:
        return (
            torch.full((TENSOR_ELEMENTS,), fill)
            if fill is not None
            else torch.randn(TENSOR_ELEMENTS, generator=g)
        )

    names = [f"layer{i:03d}.weight" for i in range(count)]
    return {
        "model": {n: tensor() for n in names},
        "optim": {"state": {n: {"exp_avg": tensor(), "exp_avg_sq": tensor().abs()} for n in names}},
        "train": {"step": 1},
    }


def load_unchecked(store: CheckpointStore, state: dict) -> None:
    location, folder = lookup.resolve(store.location, "latest")
    assert not isinstance(lookup.inspect(location, folder), str)
    dcp.load(state, storage_reader=location.dcp_reader(folder), planner=SafeLoadPlanner(), no_dist=True)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.5, help="Checkpoint size, GiB.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--name", default="resume_integrity", help="Results file benchmarks/results/NAME.json."
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bigclip-resume-bench-") as tmp:
        store = CheckpointStore(str(Path(tmp) / "checkpoints"), io_threads=1)
        saved = make_state(int(args.gib * 2**30))
        store.save(saved, step=1)
        total = store.location.list_files("step_00000001")
        gb = sum(total.values()) / 1e9
        del saved
        target = make_state(int(args.gib * 2**30), fill=0.0)
        methods = {
            "verified": lambda: store.load(target, "latest"),
            "unchecked": lambda: load_unchecked(store, target),
        }
        for fn in methods.values():  # warm the page cache and the allocator
            fn()
        times: dict[str, list[float]] = {m: [] for m in methods}
        for round_ in range(args.repeats):
            for name in list(methods) if round_ % 2 == 0 else list(reversed(methods)):
                times[name].append(timed(methods[name]))
        store.close()
    median = {m: statistics.median(t) for m, t in times.items()}
    rows = [
        {"method": m, "median s": round(median[m], 3), "min s": round(min(times[m]), 3),
         "GB/s": round(gb / median[m], 3), "vs unchecked": round(median[m] / median["unchecked"], 3)}
        for m in methods
    ]  # fmt: skip
    print(f"checkpoint: {gb:.2f} GB on local disk (warm page cache), {args.repeats} rounds")
    print_table(rows)
    overhead = median["verified"] / median["unchecked"] - 1
    print(f"verification overhead: {overhead:+.1%} (goal: at most +10%)")
    write_results(args.name, rows, checkpoint_gb=round(gb, 3), rounds=args.repeats,
                  overhead=round(overhead, 4), samples={m: [round(t, 4) for t in ts] for m, ts in times.items()})  # fmt: skip


if __name__ == "__main__":
    main()
