"""The preemption signals, caught from a run's first moment: before torch is even imported.

SLURM and torchrun deliver SIGUSR1 or SIGTERM at any time, start-up included; both kill a Python
process that has no handler for them (their default action), and importing torch alone takes
seconds. `python -m bigclip.train` therefore installs this flag before anything else
(`catch_preemption_signals()` in __main__.py); the loop's PreemptionWatcher reads it at step
boundaries. The handler only records the first signal and when it came: anything more (logging,
I/O) is unsafe inside a signal handler. Imports nothing but the standard library.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class SignalFlag:
    """The first preemption signal this process received (0: none yet) and when (monotonic s)."""

    def __init__(self) -> None:
        self.signum = 0
        self.received_at = 0.0
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> SignalFlag:
        """Idempotent; a no-op outside the main thread, where Python cannot install handlers."""
        if not self._previous and threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            # A launcher may start us with them blocked (bigclip/launch/deepspeed_node.py keeps
            # DeepSpeed's launchers from acting on them): one that came meanwhile is delivered now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:  # the first one wins: it is what the requeue marker reports
            self.signum, self.received_at = signum, time.monotonic()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def reset(self) -> None:
        self.signum, self.received_at = 0, 0.0


_FLAG = SignalFlag()


def catch_preemption_signals() -> SignalFlag:
    """This process's flag, installed (the same object on every call)."""
    return _FLAG.install()


def preemption_flag() -> SignalFlag:
    """This process's flag, as it is (for readers in other threads, e.g. the step watchdog)."""
    return _FLAG
