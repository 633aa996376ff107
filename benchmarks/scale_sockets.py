"""Sockets per process of a real bigclip world at 4-32 gloo ranks, with gloo's lazy connections and
with its full mesh, extrapolated to 1024 ranks (issue 37, goal 6). Writes
benchmarks/results/scale_sockets.json.

    python benchmarks/scale_sockets.py [--worlds 4 8 16 32]

Each world is W real processes set up as srun starts bigclip (tests/support/socket_probe.py:
env://, rank 0 hosting the rendezvous store, `cpu_group`, the step watchdog's store connection, a
CheckpointStore and its gloo group), counting the sockets in /proc/self/fd after set-up, after
per-step collectives, and after a checkpoint and an async save whose collectives run on a
background thread beside the training's. Rows: rank 0 (the store's host and the checkpoint
coordinator) and the most any other rank held, per mode. Then a least-squares fit per mode and
rank kind (a + b*W for a full mesh; lazily a + b*W + c*log2(W) for rank 0, a + c*log2(W) for the
others), extrapolated to 64-1024 ranks beside the open files the preflight asks of every process
(train/preflight.py, open_files_needed, for a GPU run: NCCL training group, two gloo groups).

`measure(worlds)` returns the rows (benchmarks/scale_sim.py imports it).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.socket_probe import PHASES, probe  # noqa: E402

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.train.preflight import FD_BASE, open_files_needed  # noqa: E402

WORLDS = [4, 8, 16, 32]
EXTRAPOLATE = [64, 128, 256, 512, 1024]
COLUMNS = ["world", "gloo", "rank 0 sockets", "other ranks' sockets (most)", "rank 0 open files",
           "preflight need", "measured or fit", "collectives ok"]  # fmt: skip
# The terms each count is fitted on: rank 0 holds a socket per rank per full-mesh group, the store's
# two per rank and the checkpoint group's, and (lazily) a few more per doubling of the world.
TERMS = {("lazy", 0): ("1", "W", "log2 W"), ("lazy", 1): ("1", "log2 W"),
         ("full mesh", 0): ("1", "W"), ("full mesh", 1): ("1", "W")}  # fmt: skip


def measure(worlds: list[int] = WORLDS) -> list[dict[str, Any]]:
    """Measured rows for `worlds`, then fitted rows for 64-1024 ranks."""
    rows = []
    for world in worlds:
        for lazy in (True, False):
            rows.append(_measured(world, lazy, probe(world, lazy=lazy)))
            print_table(rows[-1:], COLUMNS)
    return rows + extrapolate(rows)


def _measured(world: int, lazy: bool, ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    others = {r: c for r, c in ranks.items() if r != 0}
    return {
        "world": world, "gloo": "lazy" if lazy else "full mesh", "rank 0 sockets": ranks[0]["checkpoint"],
        "other ranks' sockets (most)": max(c["checkpoint"] for c in others.values()),
        "rank 0 open files": ranks[0]["open_files"], "preflight need": preflight_need(world, lazy=lazy),
        "measured or fit": "measured",
        "collectives ok": all(c["collectives_ok"] and c["committed"] for c in ranks.values()),
        "rank 0 by phase": {p: ranks[0][p] for p in PHASES},
        "other ranks by phase": {p: max(c[p] for c in others.values()) for p in PHASES},
    }  # fmt: skip


def preflight_need(world: int, *, lazy: bool) -> int:
    """The open files the preflight asks of every process of a GPU run (NCCL training group)."""
    return sum(open_files_needed(world, hosts_store=True, gloo_world=False, lazy=lazy).values())


def extrapolate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for mode in ("lazy", "full mesh"):
        measured = [r for r in rows if r["gloo"] == mode and r["measured or fit"] == "measured"]
        worlds = [r["world"] for r in measured]
        rank0 = _fit(worlds, [r["rank 0 sockets"] for r in measured], TERMS[mode, 0])
        other = _fit(worlds, [r["other ranks' sockets (most)"] for r in measured], TERMS[mode, 1])
        files = sum(r["rank 0 open files"] - r["rank 0 sockets"] for r in measured) / len(measured)
        for world in EXTRAPOLATE:
            sockets = round(rank0(world))
            out.append({"world": world, "gloo": mode, "rank 0 sockets": sockets,
                        "other ranks' sockets (most)": round(other(world)), "rank 0 open files": round(sockets + files),
                        "preflight need": preflight_need(world, lazy=mode == "lazy"), "measured or fit": "fit",
                        "collectives ok": None})  # fmt: skip
    return out


def _fit(worlds: list[int], counts: list[int], terms: tuple[str, ...]) -> Any:
    """Least squares on `terms` of W; the fitted count as a function of W."""
    import numpy as np

    def basis(w: float) -> list[float]:
        return [{"1": 1.0, "W": float(w), "log2 W": math.log2(w)}[t] for t in terms]

    coef, *_ = np.linalg.lstsq(
        np.array([basis(w) for w in worlds]), np.array(counts, dtype=float), rcond=None
    )
    return lambda w: float(np.dot(coef, basis(w)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=WORLDS)
    rows = measure(parser.parse_args().worlds)
    print_table(rows, COLUMNS)
    write_results("scale_sockets", rows, fd_base=FD_BASE)


if __name__ == "__main__":
    main()
