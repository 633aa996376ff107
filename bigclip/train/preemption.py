"""Preemption: a signal asks the run to checkpoint and exit with the code that requeues it.

Which signal comes how (docs/scale-and-slurm.md "Preemption and requeue" has the table, tested
against a real Slurm):
SLURM sends SIGUSR1 ahead of the time limit with `#SBATCH --signal=USR1@SECONDS`, and SIGTERM
when it preempts (to the job steps), requeues or cancels (to every process of the job); torchrun
passes what it receives on to each rank's whole process group; SIGINT (Ctrl-C) counts the same.
signals.py catches them from the process's first moment and says at once what the run does;
data-loader workers ignore them (data/worker_signals.py), so the rank decides when they stop.
Before the first step completes there is nothing to checkpoint, and the rank exits with 85 at
once (signals.py). From then on, at the next step boundary the ranks agree (the Checkpointer's one
tiny all-reduce over a CPU group, since signals reach ranks at different moments; an epoch's end
is such a boundary too), checkpoint, wait for the upload, and exit with REQUEUE_EXIT_CODE. Rank 0
also writes the requeue marker, RUN_DIR/requeue-JOBID.json (`write_requeue_marker`): torchrun exits 1 when its workers exit
85, so the sbatch scripts in slurm/ requeue the job on the marker (or on 85 from srun). The
requeued job resumes with `--resume latest` at the exact step.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch.distributed as dist

from bigclip.distributed import cpu_group
from bigclip.train.signals import (
    REQUEUE_EXIT_CODE,
    REQUEUE_MARKER,
    requeue_marker_path,
    write_requeue_marker,
)

__all__ = ["REQUEUE_EXIT_CODE", "REQUEUE_MARKER", "Preempted", "announce_requeue", "requeue_marker_path",
           "write_requeue_marker"]  # fmt: skip


class Preempted(Exception):
    """Raised by the loop after the preemption checkpoint is committed."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} at step {step}: checkpoint committed")


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
