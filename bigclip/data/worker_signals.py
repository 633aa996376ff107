"""Data-loader workers die of no preemption signal and outlive no rank.

SIGTERM and SIGUSR1 (and SIGINT, Ctrl-C in a terminal) reach the workers as well as their rank
whenever they go to a whole process tree or group: Slurm's proctrack/linuxproc signals every
process of a job step, torchrun forwards with killpg, a terminal signals its foreground group. PyTorch's workers exit on SIGTERM (its C handler) and SIGUSR1's default
action kills them; the rank then fails with "DataLoader worker ... is killed by signal" before it
could checkpoint. So each worker blocks both and leaves them to a small thread that waits for
them: only a SIGTERM from the worker's own rank (the DataLoader terminating a worker that did
not stop in time, also at interpreter exit) ends it; from anyone else they are dropped. The rank
decides: it finishes the step, checkpoints, and shuts its workers down as usual. (Plain SIG_IGN
would not do: multiprocessing's exit handler terminates daemonic children, then joins them
without a timeout, so a rank leaving on an exception would hang at exit.) Finally the worker asks
the kernel to SIGKILL it should its rank die first (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

SHIELDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # the training loop's stop signals (Ctrl-C too)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def shield_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: runs in the worker after PyTorch's own signal set-up."""
    rank_pid = os.getppid()
    # Blocked in this thread, hence in every thread started from now on; the waiter takes them.
    signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    threading.Thread(
        target=_take_signals, args=(rank_pid,), name="bigclip-worker-signals", daemon=True
    ).start()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != rank_pid:  # the rank died before prctl took effect
            os._exit(1)


def _take_signals(rank_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo(SHIELDED)
        if info.si_signo == signal.SIGTERM and info.si_pid == rank_pid:
            os._exit(0)  # what PyTorch's own handler does for its rank's SIGTERM
