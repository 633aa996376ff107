"""Waits for the real-Slurm tests, taken from the machine they run on rather than fixed.

On a busy 2-core box everything a job does (a rank's start-up, its steps, a requeue's restart)
takes several times longer than on an idle one, so a fixed deadline either fails a healthy run
there or waits needlessly long everywhere. Instead:

- `rank_start_up_s()` measures, here and now, what a rank does before its first step: a fresh
  interpreter importing torch and the training loop. It is the unit the tests scale by (how long
  a step may take before a watchdog may call it hung, how long a requeue may take).
- `Patience` waits for as long as the jobs move (a state, a restart count, a step trained): it
  fails only once nothing has moved for `stall_s`, which the tests derive from the start-up time,
  so a job that is slow but alive is waited for and a stuck one fails in minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STALL_FLOOR_S = 180.0  # the least a wait allows without movement (a requeue's restart, idle box)


def rank_start_up_s() -> float:
    """Seconds a fresh interpreter takes, on this box now, to import torch and the training loop."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, bigclip.train.trainer"], check=True, timeout=900,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)  # fmt: skip
    return time.monotonic() - start


def stall_limit_s(start_up_s: float, *, starts: float = 8.0, extra_s: float = 0.0) -> float:
    """How long the jobs may show no movement: `starts` rank start-ups plus `extra_s` (a watchdog
    limit the test sets, say), at least STALL_FLOOR_S."""
    return max(STALL_FLOOR_S, starts * start_up_s + extra_s)


@dataclass
class Patience:
    """Wait while something moves; fail once nothing has for `stall_s` seconds."""

    stall_s: float
    poll_s: float = 1.0

    def wait(self, done: Callable[[], bool], progress: Callable[[], object], *, what: str) -> None:
        """Until `done()`; `progress()` returns anything that changes whenever the jobs move."""
        last, moved_at = progress(), time.monotonic()
        while not done():
            time.sleep(self.poll_s)
            now = progress()
            if now != last:
                last, moved_at = now, time.monotonic()
            elif time.monotonic() - moved_at > self.stall_s:
                raise AssertionError(f"{what}: nothing moved for {self.stall_s:.0f} s; last seen {now}")


def file_size(path: Path) -> int:
    """A progress mark: the size of a file that grows as a job trains (its batch keys)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
