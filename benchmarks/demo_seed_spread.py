"""Do the demo's figures hold from seed to seed? The whole `bigclip demo` at N seeds, side by side.

  PYTHONPATH=$PWD python benchmarks/demo_seed_spread.py [--seeds 0 1 2 3 4] [--parallel 1] [--keep DIR]

Each seed runs the demo exactly as `make demo` does (`python -m bigclip demo --seed S`: data,
loopback S3, 2 ranks under torchrun, SIGUSR1, the resume on 1 rank, held-out retrieval and
zero-shot classification), each in its own folder on the same data (written once: the data do
not depend on the seed). It prints one row per seed and each figure's range, and writes
benchmarks/results/demo_seed_spread.json: every run's summary (what it printed,
bigclip/demo/report.py) and the spread. The README's demo block is rendered from that file: the
run at seed 0 (the default, what `make demo` runs) and the range over all seeds.
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import env_with_checkout, print_table, write_results  # noqa: E402
from bigclip.demo.report import FIGURES, SUMMARY_FILE, DemoSummary  # noqa: E402


def run_demo(seed: int, folder: Path, data: Path | None) -> subprocess.Popen:
    """`bigclip demo --seed SEED --out FOLDER`, the data linked from the first run's folder."""
    folder.mkdir(parents=True, exist_ok=True)
    if data is not None and not (folder / "data").exists():
        (folder / "data").symlink_to(data)
    log = open(folder / "demo.log", "w")  # noqa: SIM115 (closed with the process)
    cmd = [sys.executable, "-m", "bigclip", "demo", "--seed", str(seed), "--out", str(folder)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env_with_checkout())


def finish(seed: int, proc: subprocess.Popen, folder: Path, started: float) -> dict:
    """Wait for one demo; its summary, wall and CPU seconds (the run and every process it waited for)."""
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = (folder / "demo.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"demo_seed_spread: the demo at seed {seed} failed ({proc.returncode}):\n{tail}")
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    return {"seed": seed, "summary": summary, "wall_s": round(seconds, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}  # fmt: skip


def run_all(seeds: list[int], root: Path, *, parallel: int) -> list[dict]:
    """The first seed alone (it writes the data), then the others `parallel` at a time."""
    runs, data = [], None
    pending = list(seeds)
    while pending:
        batch = [pending.pop(0) for _ in range(1 if data is None else min(parallel, len(pending)))]
        started = time.monotonic()
        procs = [(s, run_demo(s, root / f"seed{s}", data)) for s in batch]
        for seed, proc in procs:
            runs.append(finish(seed, proc, root / f"seed{seed}", started))
            print(f"seed {seed}: {runs[-1]['wall_s']:.0f} s", flush=True)
        data = data or (root / f"seed{batch[0]}" / "data").resolve()
    return sorted(runs, key=lambda r: r["seed"])


def spread(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per figure: min, max, mean, sample standard deviation and half the range (the '±')."""
    out = {}
    for field in FIGURES:
        values = [r["summary"][field] for r in runs if r["summary"][field] is not None]
        if not values:
            continue
        lo, hi = min(values), max(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        out[field] = {
            "min": lo,
            "max": hi,
            "mean": statistics.fmean(values),
            "stdev": sd,
            "half_range": (hi - lo) / 2,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument(
        "--parallel", type=int, default=1, help="Demos at once after the first (1: as make demo runs)."
    )
    p.add_argument("--keep", default="", help="Folder for the runs (kept); default: a temporary one.")
    args = p.parse_args()
    if len(args.seeds) < 3:
        raise SystemExit("demo_seed_spread: give at least 3 seeds: a spread needs them")
    with tempfile.TemporaryDirectory(prefix="demo_seed_spread_") as tmp:
        runs = run_all(args.seeds, Path(args.keep or tmp).resolve(), parallel=args.parallel)
    rows = [
        {"seed": r["seed"], **{f: r["summary"][f] for f in FIGURES}, "resumed_at": r["summary"]["resumed_at"],
         "final_loss": r["summary"]["loss_1_rank"][1], "wall_s": r["wall_s"], "cpu_s": r["cpu_s"]}
        for r in runs
    ]  # fmt: skip
    print_table(rows)
    figures = spread(runs)
    for field, s in figures.items():
        print(
            f"{FIGURES[field]}: {100 * s['min']:.1f}-{100 * s['max']:.1f}% (±{100 * s['half_range']:.1f} points)"
        )
    DemoSummary.from_dict(runs[0]["summary"])  # the file must hold summaries the README can render
    write_results("demo_seed_spread", rows, summaries=[r["summary"] for r in runs], spread=figures,
                  parallel=args.parallel)  # fmt: skip


if __name__ == "__main__":
    main()
