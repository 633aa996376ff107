"""The fp8 loss-curve benchmark (issue 30's numerics goal) judges fp8 runs against the bf16 runs'
spread, gives no verdict where bf16 never learned, and runs end to end on CPU so that a GPU lease
is not spent on its plumbing."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fp8_loss_curve_gpu as bench  # noqa: E402

STEPS, BATCH = 120, 64


def learning(start: float, end: float, wobble: float, phase: float) -> list[float]:
    """A loss falling from `start` to `end`, with a run's own small noise."""
    return [
        start + (end - start) * i / (STEPS - 1) + wobble * math.sin(i * 0.7 + phase) for i in range(STEPS)
    ]


def verdicts(fp8: list[float], bf16: tuple[list[float], list[float]]) -> dict:
    curves = {"bf16-seed0": bf16[0], "bf16-seed1": bf16[1], "fp8-tensorwise": fp8}
    rows = bench.judge(curves, warmup=30, batch=BATCH)
    return next(r for r in rows if r["run"] == "fp8-tensorwise")


def test_an_fp8_curve_inside_the_bf16_spread_meets_the_goal_and_one_outside_does_not():
    chance = math.log(BATCH)
    bf16 = (learning(chance, 2.0, 0.05, 0.0), learning(chance, 2.1, 0.05, 1.0))
    assert verdicts(learning(chance, 2.05, 0.05, 2.0), bf16)["goal_met"] is True
    stuck = verdicts(learning(chance, 3.5, 0.05, 2.0), bf16)
    assert stuck["goal_met"] is False and stuck["verdict"] == "outside the bf16 spread"


def test_no_verdict_when_bf16_never_left_chance():
    chance = math.log(BATCH)  # what a GPU run of 60 steps at lr 5e-4 gave, bf16 and fp8 alike
    flat = (learning(chance, chance, 0.001, 0.0), learning(chance, chance, 0.001, 1.0))
    row = verdicts(learning(chance, chance, 0.001, 2.0), flat)
    assert row["goal_met"] is None and row["verdict"].startswith("no signal")


def test_the_runs_keep_the_callers_python_path(monkeypatch):
    # a GPU node's carried wheels are unpacked into a folder named on PYTHONPATH: losing it lost braceexpand
    monkeypatch.setenv("PYTHONPATH", "/tmp/carried-site")
    assert bench.env_with_checkout()["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/carried-site"]


@pytest.mark.slow
def test_the_pipeline_runs_on_cpu():
    done = subprocess.run([sys.executable, "benchmarks/fp8_loss_curve_gpu.py", "--cpu-smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for run, _, _ in bench.RUNS:
        assert run in done.stdout
