"""Preemption: a signal asks the run to checkpoint and exit with the code that requeues it.

SLURM sends SIGUSR1 ahead of the time limit with `#SBATCH --signal=USR1@SECONDS` (to every
task of the job step), and SIGTERM when it preempts or cancels. The handler only sets a flag;
at the next step boundary the ranks agree (one tiny all-reduce over a CPU group, since
signals reach ranks at different moments), checkpoint, wait for the upload, and exit with
REQUEUE_EXIT_CODE. Rank 0 also writes RUN_DIR/requeue.json (`announce_requeue`): torchrun
exits 1 when its workers exit 85, so the sbatch scripts in slurm/ requeue the job on the marker
(or on 85 from srun). The requeued job resumes with `--resume latest` at the exact step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from bigclip.distributed import cpu_group

REQUEUE_EXIT_CODE = 85
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
REQUEUE_MARKER = "requeue.json"  # in the run directory; read by the sbatch scripts


class Preempted(Exception):
    """Raised by the loop after the preemption checkpoint is committed."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} at step {step}: checkpoint committed")
        self.step = step
        self.signum = signum


class PreemptionWatcher:
    """Install first thing in a run: a signal during start-up must not kill it (SIGUSR1's default)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def requested(self) -> int:
        """Collective: the signal number if any rank was signalled, else 0."""
        flag = torch.tensor([self.signum], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group())
        return int(flag.item())

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def announce_requeue(run_dir: Path, *, step: int, signum: int, is_main: bool) -> None:
    """Call once the preemption checkpoint is committed. Rank 0 writes the requeue marker
    (atomically: the batch script may read it at any moment); then every rank waits for the
    others, so a launcher that kills the remaining ranks as soon as one exits (srun
    --kill-on-bad-exit, DeepSpeed's launcher) cannot cut the commit or the marker short."""
    if is_main:
        marker = Path(run_dir) / REQUEUE_MARKER
        tmp = marker.with_name(f".{marker.name}.tmp")
        tmp.write_text(json.dumps({"step": step, "signal": signal.Signals(signum).name}) + "\n")
        os.replace(tmp, marker)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=cpu_group())
