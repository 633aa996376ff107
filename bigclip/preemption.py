"""Preemption: a signal asks the run to checkpoint and exit with the code that requeues it.

SLURM sends SIGUSR1 ahead of the time limit with `#SBATCH --signal=USR1@SECONDS` (to every
task of the job step), and SIGTERM when it preempts or cancels. The handler only sets a flag;
at the next step boundary the ranks agree (one tiny all-reduce over a CPU group, since
signals reach ranks at different moments), checkpoint, wait for the upload, and exit with
REQUEUE_EXIT_CODE. The sbatch scripts in slurm/ requeue the job on that code, and the
requeued job resumes with `--resume latest` at the exact step.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from bigclip.distributed import cpu_group

REQUEUE_EXIT_CODE = 85
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


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
