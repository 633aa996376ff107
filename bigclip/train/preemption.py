"""Preemption: a signal asks the run to checkpoint and exit with the code that requeues it.

Which signal comes how (docs/scale-and-slurm.md "Preemption and requeue" has the table, tested
against a real Slurm):
SLURM sends SIGUSR1 ahead of the time limit with `#SBATCH --signal=USR1@SECONDS`, and SIGTERM
when it preempts (to the job steps), requeues or cancels (to every process of the job); torchrun
passes what it receives on to each rank's whole process group. signals.py catches them from the
process's first moment; data-loader workers ignore them (data/worker_signals.py), so the rank
decides when they stop. At the next step boundary the ranks agree (the Checkpointer's one tiny
all-reduce over a CPU group, since signals reach ranks at different moments), checkpoint, wait
for the upload, and exit with REQUEUE_EXIT_CODE. Rank 0 also writes RUN_DIR/requeue.json
(`write_requeue_marker`): torchrun exits 1 when its workers exit 85, so the sbatch scripts in
slurm/ requeue the job on the marker (or on 85 from srun). The requeued job resumes with `--resume latest` at the exact step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bigclip.distributed import cpu_group
from bigclip.train.metrics import get_logger
from bigclip.train.signals import SignalFlag, catch_preemption_signals

REQUEUE_EXIT_CODE = 85
REQUEUE_MARKER = "requeue.json"  # in the run directory; read by the sbatch scripts


class Preempted(Exception):
    """Raised by the loop after the preemption checkpoint is committed."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} at step {step}: checkpoint committed")
        self.step = step
        self.signum = signum


class PreemptionWatcher:
    """Install first thing in a run: a signal during start-up must not kill it (SIGUSR1's default).
    A signal caught before (by __main__.py, ahead of the torch import) is kept."""

    def __init__(self) -> None:
        self.flag: SignalFlag = catch_preemption_signals()

    @property
    def signum(self) -> int:
        return self.flag.signum

    def announce(self, signum: int) -> None:
        """Log the stop request the ranks agreed on (`signum`: any rank's signal), and who had it."""
        mine = self.flag.signum
        seen = f"{time.monotonic() - self.flag.received_at:.1f} s ago" if mine else "by another rank"
        get_logger().info(f"preemption: {signal.Signals(signum).name} received {seen}; checkpointing now")

    def close(self) -> None:
        """Restore the previous handlers and forget the signal (a next run in this process starts clean)."""
        self.flag.uninstall()
        self.flag.reset()


def write_requeue_marker(run_dir: Path, record: dict[str, Any], *, writer: int) -> Path:
    """Atomically write RUN_DIR/requeue.json ("requeue this job"; the batch script may read it at
    any moment). Several ranks may write it at once (the watchdog's survivors): each through its
    own temporary file."""
    marker = Path(run_dir) / REQUEUE_MARKER
    tmp = marker.with_name(f".{marker.name}.{writer}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, marker)
    return marker


def announce_requeue(
    run_dir: Path, *, step: int, signum: int, is_main: bool, reason: str = "preempted"
) -> None:
    """Call once the preemption checkpoint is committed (or, `reason` "checkpoint failed", once the
    stop request's or the end's checkpoint failed: the rerun resumes from the latest committed
    one). Rank 0 writes the requeue marker; then every rank waits for the others, so a launcher
    that kills the remaining ranks as soon as one exits (srun --kill-on-bad-exit, DeepSpeed's
    launcher) cannot cut the commit or the marker short."""
    if is_main:
        name = signal.Signals(signum).name if signum else None
        write_requeue_marker(run_dir, {"step": step, "signal": name, "reason": reason}, writer=0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=cpu_group())
