"""What `bigclip demo` reports: one summary per run, printed and written as OUT/summary.json.

The same `summary_lines` prints the demo's closing block and renders the README's copy of it
(benchmarks/render_docs.py, from benchmarks/results/demo_seed_spread.json, which holds the
summaries of real demo runs at several seeds): the README shows what a run printed, never typed
figures. Reads only the standard library (the docs renderer imports it without torch).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

LOSS = re.compile(r"Contrastive_loss: ([0-9.]+)")
RESUMED = re.compile(r"resumed \S+ at step (\d+)")
SUMMARY_FILE = "summary.json"
FIGURES = {  # the figures whose seed-to-seed spread is measured (benchmarks/demo_seed_spread.py)
    "image_to_text": "held-out retrieval, image -> text",
    "text_to_image": "held-out retrieval, text -> image",
    "zeroshot_top1": "zero-shot classification by shape",
}


@dataclass(frozen=True)
class DemoSummary:
    """The figures of one demo run (fractions, not percentages)."""

    seed: int
    loss_2_ranks: tuple[float, float]  # first and last logged global loss before the preemption
    resumed_at: int | None  # the step the 1-rank rerun resumed at
    loss_1_rank: tuple[float, float]  # first and last logged loss after the resume
    checkpoints: list[int]  # committed checkpoints on the loopback S3, newest first
    pairs: int  # held-out image-caption pairs (distinct captions)
    image_to_text: float  # held-out retrieval top-1
    text_to_image: float
    classes: int  # zero-shot classification by shape
    classify_images: int
    zeroshot_top1: float | None
    global_batch: int

    @classmethod
    def from_dict(cls, d: dict) -> DemoSummary:
        return cls(**{**d, "loss_2_ranks": tuple(d["loss_2_ranks"]), "loss_1_rank": tuple(d["loss_1_rank"])})

    def write(self, out: Path) -> Path:
        path = Path(out) / SUMMARY_FILE
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path


def losses(lines: list[str]) -> list[float]:
    """The global loss of every console log line, in order."""
    return [float(m.group(1)) for line in lines if (m := LOSS.search(line))]


def resumed_at(lines: list[str]) -> int | None:
    return next((int(m.group(1)) for line in lines if (m := RESUMED.search(line))), None)


def first_last(values: list[float]) -> tuple[float, float]:
    return (values[0], values[-1]) if values else (float("nan"), float("nan"))


def summary_lines(s: DemoSummary) -> list[str]:
    """The demo's closing block (the README shows these lines of a real run)."""
    from math import log

    chance = 1 / s.pairs
    lines = [
        f"loss (2 ranks):        {s.loss_2_ranks[0]:.3f} -> {s.loss_2_ranks[1]:.3f}   "
        f"(chance level log({s.global_batch}) = {log(s.global_batch):.3f})",
        f"resumed on 1 rank at:  step {s.resumed_at}, from the latest committed S3 checkpoint",
        f"loss (1 rank):         {s.loss_1_rank[0]:.3f} -> {s.loss_1_rank[1]:.3f}",
        f"checkpoints on S3:     steps {s.checkpoints}",
        f"held-out retrieval top-1 over {s.pairs} pairs (chance {100 * chance:.2f}%):",
        f"   image -> text: {100 * s.image_to_text:.1f}%   text -> image: {100 * s.text_to_image:.1f}%",
    ]
    if s.zeroshot_top1 is not None:
        lines.append(
            f"zero-shot classification of {s.classify_images} new images by shape ({s.classes} classes, "
            f"chance {100 / s.classes:.0f}%): top-1 {100 * s.zeroshot_top1:.1f}%"
        )
    return lines


def spread_table(summaries: list[DemoSummary]) -> list[list[str]]:
    """Rows (figure, seed 0's value, range over all runs, half the range) for the README."""
    rows = []
    default = next(s for s in summaries if s.seed == 0)
    for field, label in FIGURES.items():
        values = [getattr(s, field) for s in summaries if getattr(s, field) is not None]
        if not values or getattr(default, field) is None:
            continue
        lo, hi = min(values), max(values)
        rows.append([label, f"{100 * getattr(default, field):.1f}%", f"{100 * lo:.1f}-{100 * hi:.1f}%",
                     f"±{100 * (hi - lo) / 2:.1f} points"])  # fmt: skip
    return rows
