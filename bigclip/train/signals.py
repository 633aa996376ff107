"""Stop signals (SIGUSR1, SIGTERM, SIGINT), caught from a run's first moment, before torch is even
imported, and answered at once in the log with what the run does about them.

Slurm and torchrun deliver SIGUSR1 or SIGTERM at any time, start-up included; both kill a process
that has no handler for them, and importing torch alone takes seconds. `bigclip train` installs
the handlers first thing (entry.py). What a signal does depends on the run's phase (phases.py):
  - before the first step completes (start-up, building the model, reading a checkpoint, the first
    step and its compilation): nothing was trained since the run started, so there is nothing to
    checkpoint. The rank exits at once with 85 (requeue): the handler raises StopRequested in the
    main thread (a BaseException, like KeyboardInterrupt, so no `except Exception` swallows it;
    a stop noted while the main thread was away is raised at its next phase change), and entry.py
    turns it into exit code 85 and the requeue marker.
  - while training: the ranks agree at the next step boundary (the Checkpointer's all-reduce),
    checkpoint that step and exit with 85 (preemption.py).
  - after the last step: the run completes its final checkpoint and exits.
A second SIGINT (Ctrl-C twice) stops at once, as KeyboardInterrupt.

Said at once, whatever the main thread does. Python runs a signal handler only when the main
thread next executes Python code, and a rank can spend minutes in C (a collective waiting for a
peer that compiles, a stalled read, a CUDA sync). So the C-level handler also writes the signal's
number to a pipe (`signal.set_wakeup_fd`), and a watcher thread reading it notes the signal and
logs the line within milliseconds; it also polls the flag (in case something else took the
wakeup fd) and gives the open phase its heartbeat. If the main thread, told to exit at once, is
still there BIGCLIP_STOP_GRACE_S later (default 30; stuck in C code), the watcher writes the
requeue marker and ends the process with 85 itself: nothing was trained, nothing is lost.
Forked children (data workers) drop the inherited wakeup pipe. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from bigclip.train import phases
from bigclip.train.phases import OnStop, exit_now, say

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
REQUEUE_EXIT_CODE = 85
REQUEUE_MARKER = "requeue.json"  # in the run directory, outside a Slurm job (requeue_marker_path)
GRACE_ENV = "BIGCLIP_STOP_GRACE_S"
DEFAULT_GRACE_S = 30.0
POLL_S = 0.5  # the watcher's longest sleep: heartbeats and the flag are checked this often

CONSEQUENCE = {
    OnStop.EXIT_NOW: f"no step taken since the run started, nothing to checkpoint; exiting now with "
    f"{REQUEUE_EXIT_CODE} (requeue)",
    OnStop.AT_BOUNDARY: f"the ranks stop at the next step boundary: they checkpoint that step and exit "
    f"with {REQUEUE_EXIT_CODE} (requeue)",
    OnStop.FINISH: "training is over: the run completes its final checkpoint and exits",
}


class StopRequested(BaseException):
    """Raised in the main thread for a stop signal that came before the first step completed."""

    def __init__(self, signum: int, phase: str) -> None:
        super().__init__(signum, phase)  # its arguments, so it pickles (DCP gathers a load's errors)
        self.signum, self.phase = signum, phase

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name} received during {self.phase}: nothing to checkpoint"


def requeue_marker_path(run_dir: Path) -> Path:
    """This job's requeue marker in RUN_DIR, read by the sbatch script: requeue-JOBID.json in a Slurm
    job (a requeued job keeps its id), so that a second job given the same --name, which the run's
    lock refuses, neither removes the first's marker nor requeues itself on it; requeue.json
    elsewhere."""
    job = os.environ.get("SLURM_JOB_ID", "")
    return Path(run_dir) / (f"requeue-{job}.json" if job else REQUEUE_MARKER)


def write_requeue_marker(run_dir: Path, record: dict[str, Any], *, writer: int) -> Path:
    """Atomically write this job's requeue marker ("requeue this job"; the batch script may read it
    at any moment). Several ranks may write it at once (the watchdog's survivors): each through its
    own temporary file."""
    marker = requeue_marker_path(run_dir)
    tmp = marker.with_name(f".{marker.name}.{writer}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, marker)
    return marker


class SignalFlag:
    """The first stop signal this process received (0: none yet), when, in which phase, and
    whether it ends the run at once; with the watcher thread that says so."""

    def __init__(self) -> None:
        self._clear()
        self.installed_at = 0.0  # wall clock: a marker older than this is an earlier run's
        self._previous: dict[int, Any] = {}
        self._lock = threading.RLock()  # re-entrant: the main thread's handler may run while it holds it
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._watcher: threading.Thread | None = None
        self._quit = threading.Event()

    @property
    def said(self) -> bool:
        """The line about the signal is out."""
        return self._said

    def install(self) -> SignalFlag:
        """Idempotent; a no-op outside the main thread, where Python cannot install handlers."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return self
        phases.reset()
        self.installed_at = time.time()
        phases.add_transition_hook(self.raise_if_due)
        self._start_watcher()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        # A launcher may start us with them blocked (bigclip/launch/deepspeed_node.py keeps
        # DeepSpeed's launchers from acting on them): one that came meanwhile is delivered now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def note(self, *, run_dir: Path | None = None, step: int | None = None, rank: int | None = None) -> None:
        """What the stop needs to know of the run, as set-up learns it."""
        self.run_dir = run_dir if run_dir is not None else self.run_dir
        self.step = step if step is not None else self.step
        self.rank = rank if rank is not None else self.rank

    # -- receiving ------------------------------------------------------------------------

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler (main thread, between two bytecodes)."""
        self._handled += 1
        if signum == signal.SIGINT and self._handled > 1:
            raise KeyboardInterrupt  # Ctrl-C again while stopping: stop now, without a checkpoint
        self._record(signum)
        self.raise_if_due()

    def _record(self, signum: int) -> bool:
        """Note the first stop signal and what it does in the current phase (either thread)."""
        with self._lock:
            if self.signum:
                return False
            self.signum, self.received_at = signum, time.monotonic()
            self.phase, self.on_stop = phases.current_name(), phases.stop_rule()
            self.exits_now = self.on_stop is OnStop.EXIT_NOW
            return True

    def raise_if_due(self) -> None:
        """Main thread: raise StopRequested if a stop that ends the run at once is noted (again at
        each phase change, should something have swallowed it)."""
        if self.exits_now and threading.current_thread() is threading.main_thread():
            raise StopRequested(self.signum, self.phase)

    def say_once(self) -> None:
        """The line saying what the run does about the signal (from whichever thread is first)."""
        with self._lock:
            if self._said or not self.signum:
                return
            self._said = True
        say(f"{signal.Signals(self.signum).name} received during {self.phase}: {CONSEQUENCE[self.on_stop]}")

    def announce(self, signum: int) -> None:
        """Log the stop request the ranks agreed on (`signum`: any rank's signal), and who had it."""
        seen = f"{time.monotonic() - self.received_at:.1f} s ago" if self.signum else "by another rank"
        logging.getLogger(phases.LOGGER_NAME).info(
            f"preemption: {signal.Signals(signum).name} received {seen}; checkpointing now"
        )

    def requeue_marker(self) -> None:
        """For a stop before the first step: the rank leaves the marker in an existing run folder.
        Every rank so stopped does, not rank 0 alone: a signal can reach some ranks only (a kill
        Slurm retries at a node that answers again reaches a rerun of the same job id there), and
        the others then fail in their next collective, which must not end the job FAILED."""
        if self.run_dir is not None and self.run_dir.is_dir():
            record = {"step": self.step, "signal": signal.Signals(self.signum).name,
                      "reason": f"stopped during {self.phase}: nothing trained to checkpoint",
                      "rank": self.rank, "host": socket.gethostname()}  # fmt: skip
            write_requeue_marker(self.run_dir, record, writer=os.getpid())

    def peer_stop(self) -> str:
        """A peer's stop before the first step, as the marker it left during this run says ('' for
        none): why this rank's set-up failed, when its collective found that peer gone."""
        if self.run_dir is None:
            return ""
        marker = requeue_marker_path(self.run_dir)
        try:
            if marker.stat().st_mtime < self.installed_at:
                return ""  # an earlier run's (the sbatch script removes it; torchrun does not)
            record = json.loads(marker.read_text())
        except (OSError, ValueError):
            return ""
        rank, reason = record.get("rank"), str(record.get("reason", ""))
        if rank is None or rank == self.rank or not reason.startswith("stopped during"):
            return ""
        return (
            f"rank {rank} on {record.get('host')} received {record.get('signal')} and left first ({reason})"
        )

    # -- the watcher thread ---------------------------------------------------------------

    def _start_watcher(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read)
            os.close(write)
            return
        self._pipe = (read, write)
        self._quit.clear()
        self._watcher = threading.Thread(
            target=self._watch, args=(read,), name="bigclip-stop-signals", daemon=True
        )
        self._watcher.start()

    def _watch(self, read: int) -> None:
        grace = float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE_S)
        while not self._quit.is_set():
            ready, _, _ = select.select([read], [], [], POLL_S)
            if ready:
                for signum in os.read(read, 512):
                    if signum in STOP_SIGNALS and signal.getsignal(signum) == self._handle:
                        self._record(signum)
            if self._quit.is_set():
                return
            self.say_once()  # also for a signal the handler noted (the wakeup fd taken by another)
            line = phases.heartbeat(time.monotonic())
            if line:
                say(line)
            if self.exits_now and time.monotonic() - self.received_at > grace:
                self._exit_anyway(grace)

    def _exit_anyway(self, grace: float) -> None:
        say(f"the main thread did not stop within {grace:g} s ({GRACE_ENV}) of "
            f"{signal.Signals(self.signum).name}; exiting with {REQUEUE_EXIT_CODE} now")  # fmt: skip
        try:
            self.requeue_marker()
        finally:
            exit_now(REQUEUE_EXIT_CODE)

    # -- leaving --------------------------------------------------------------------------

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            self._quit.set()
            os.write(self._pipe[1], b"\0")  # wakes the watcher (0 is no signal)
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            for fd in self._pipe:
                os.close(fd)
            self._pipe, self._watcher = None, None

    def close(self) -> None:
        """Restore the previous handlers and forget the signal (a next run in this process starts clean)."""
        self.uninstall()
        self.reset()

    def reset(self) -> None:
        self._clear()
        phases.reset()

    def _clear(self) -> None:
        """No signal received, nothing known of the run."""
        self.signum = 0
        self.received_at = 0.0
        self.phase = ""  # the phase it came in
        self.exits_now = False  # it came before the first step completed
        self.on_stop = OnStop.EXIT_NOW  # what it does, by the phase it came in
        self.run_dir: Path | None = None  # where the requeue marker goes (once known)
        self.step: int | None = None  # where the run stands, for the marker
        self.rank: int | None = None  # who writes it (once known)
        self._said = False
        self._handled = 0  # handler calls (a second SIGINT stops at once)

    def _after_fork_in_child(self) -> None:
        """A forked child (a data worker) must not write into the parent's wakeup pipe."""
        if self._pipe is not None:
            with contextlib.suppress(ValueError):  # not the child's main thread: nothing to drop
                signal.set_wakeup_fd(-1)
            for fd in self._pipe:
                os.close(fd)
            self._pipe, self._watcher = None, None


_FLAG = SignalFlag()
os.register_at_fork(after_in_child=_FLAG._after_fork_in_child)


def catch_preemption_signals() -> SignalFlag:
    """This process's flag, installed (the same object on every call)."""
    return _FLAG.install()


def preemption_flag() -> SignalFlag:
    """This process's flag, as it is (for readers in other threads, e.g. the step watchdog)."""
    return _FLAG
