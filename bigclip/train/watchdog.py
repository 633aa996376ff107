"""Step watchdog: a hung rank ends the job with a diagnosis and a requeue, a dead one fails it fast.

At 256+ nodes the common failure is not an exception but silence: a stuck NCCL collective, a
frozen node, a rank killed by the OOM killer while the others wait for it. A thread per rank
watches the one thing every engine has in common, the training loop finishing steps:

- `step_done()` after every step records the time (two assignments: no device sync, no
  collective, nothing on the step's hot path); `paused()` covers the known long stretches
  between steps (checkpoint saves, epoch ends with evaluation and a new loader).
- The limit is `--step-timeout` seconds, or by default 10x the median step time over the last
  100 steps, at least 300 s, once 10 steps have been timed (the first steps compile and warm up).
- When no step has finished within the limit, the rank dumps every thread's stack
  (faulthandler, to stderr), takes a roll call of all ranks through heartbeats in the rendezvous
  store (heartbeats.py: who stopped answering, where each one is), logs it, writes the requeue
  marker and exits with REQUEUE_EXIT_CODE: the sbatch scripts requeue the job and it resumes
  from its last committed checkpoint. Every rank does the same, so every healthy rank names the
  stuck ones; a stopped rank cannot, and srun (--kill-on-bad-exit) or torchrun ends it.
- A rank that died makes the others' next collective fail (gloo: at once; NCCL: after the
  process group's timeout, or this watchdog first): `explain_failure` then announces the failure
  in the store and names the ranks that stopped answering before the error propagates (exit code
  1, no requeue: a rank that ran out of memory would do so again). A rank blocked in a collective
  that waits for the failed one, alive but past the error, would see nothing until that process
  exits (and the store with it, under srun) or the group times out: its watchdog reads the
  announcement at its next beat, names the silent ranks too, and ends the process with 1.
- Unless every silent rank is on a node none of whose ranks answers (each rank lists itself under
  its host in the store at start), or the store itself does not answer at all (its host stopped
  or cut off; a refused connection is its process ending, a failure): then the node is lost (its
  processes killed, its kernel gone), not a rank's own failure; the survivors write the requeue
  marker and exit with REQUEUE_EXIT_CODE, as for a hang, and the job resumes from its last
  committed checkpoint once Slurm has a node for it. A hang's report names lost nodes too. A rank
  that cannot reach the store at all (cut off with its node) waits for the requeue marker of one
  that can before writing its own: the marker that stays names the silent ranks.
While a preemption signal is being handled the watchdog stands aside: the checkpoint may take
longer than a step, and the scheduler's grace time bounds it.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bigclip.config import TrainConfig
from bigclip.distributed import Runtime, side_store
from bigclip.train.bounded_store import BoundedStore
from bigclip.train.heartbeats import (
    EXTRA_INTERVALS,
    ROLL_CALL_INTERVALS,
    Heartbeats,
    RollCall,
    describe_error,
    main_thread_location,
)
from bigclip.train.metrics import get_logger
from bigclip.train.phases import exit_now
from bigclip.train.preemption import REQUEUE_EXIT_CODE, requeue_marker_path, write_requeue_marker
from bigclip.train.signals import preemption_flag

AUTO_FACTOR = 10.0
AUTO_FLOOR_S = 300.0
AUTO_MIN_STEPS = 10
DEPART_INTERVALS = 3  # how long a reporting rank waits for the others' reports before it exits
# A rank that cannot reach the store (cut off with its node) knows nothing of the others: it waits
# this long for a peer's requeue marker (the ranks that reached the store report first) before it
# writes its own, and exits only once the others have had time to finish their reports.
UNINFORMED_INTERVALS = ROLL_CALL_INTERVALS + EXTRA_INTERVALS + DEPART_INTERVALS + 1
MAX_BEAT_INTERVAL_S = 5.0  # two store requests per rank per interval: 410/s on 1024 ranks
MIN_STORE_DEADLINE_S = 10.0  # a store call unanswered for this long (or 2 intervals): its host is gone
RESUBMIT = ("Resubmit the job to resume from its last committed checkpoint once the cause (out of memory, "
            "a lost node) is dealt with.")  # fmt: skip


def step_limit(timeout_s: float, intervals: list[float] | deque) -> float | None:
    """Seconds the next step may take (None: not watching)."""
    if timeout_s < 0:
        return None
    if timeout_s > 0:
        return timeout_s
    if len(intervals) < AUTO_MIN_STEPS:
        return None
    return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(intervals))


def beat_interval(timeout_s: float) -> float:
    """A twentieth of an explicit limit (a report within ~1.2x the limit), 1 to 5 s."""
    return MAX_BEAT_INTERVAL_S if timeout_s <= 0 else min(MAX_BEAT_INTERVAL_S, max(1.0, timeout_s / 20))


def store_deadline(interval_s: float) -> float:
    return max(MIN_STORE_DEADLINE_S, 2 * interval_s)


class StepWatchdog:
    def __init__(
        self,
        *,
        timeout_s: float,
        rank: int,
        run_dir: Path,
        heartbeats: Heartbeats | None,
        exit: Callable[[int], None] | None = None,
    ) -> None:
        """`exit(code)` ends the process from the watchdog's thread (default: at once, skipping the
        interpreter's shutdown; a simulation of many ranks in one process passes its own)."""
        self.timeout_s, self.rank, self.run_dir, self.heartbeats = timeout_s, rank, Path(run_dir), heartbeats
        self.interval_s = heartbeats.interval_s if heartbeats else beat_interval(timeout_s)
        self.step = 0
        self._exit = exit or exit_now
        self._intervals: deque[float] = deque(maxlen=100)
        self._last_step_at: float | None = None  # not watching before the first step
        self._paused = 0
        self._stop = threading.Event()
        self._reporting = threading.Lock()  # one report per rank: its own failure, a peer's, or a hang
        self._thread = threading.Thread(target=self._watch, name="bigclip-step-watchdog", daemon=True)

    @classmethod
    def start_for(cls, cfg: TrainConfig, runtime: Runtime, run_dir: Path) -> StepWatchdog:
        timeout_s, beats = cfg.engine.step_timeout, None
        if runtime.world_size > 1 and timeout_s >= 0:
            interval = beat_interval(timeout_s)
            # torchrun (--max-restarts) keeps its TCPStore server across worker restarts: keys of the
            # failed attempt, its failure announcement first, must not reach the next one
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            deadline = store_deadline(interval)
            prefix = f"bigclip/heartbeats/{attempt}"
            store = BoundedStore(lambda: side_store(prefix=prefix, timeout_s=deadline), deadline_s=deadline)
            beats = Heartbeats(store, rank=runtime.rank, world_size=runtime.world_size, interval_s=interval)
            beats.start()  # listed under its host and beating from the start
        watchdog = cls(timeout_s=timeout_s, rank=runtime.rank, run_dir=run_dir, heartbeats=beats)
        if timeout_s >= 0:
            watchdog.start()
        return watchdog

    def start(self) -> None:
        self._thread.start()

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        if self._last_step_at is not None:
            self._intervals.append(now - self._last_step_at)
        self._last_step_at, self.step = now, step

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            if self._last_step_at is not None:
                self._last_step_at = time.monotonic()  # the next step's time starts now

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            # a roll call is open: a peer may have announced its failure (read only then)
            if self.heartbeats is not None and self.heartbeats.beat(self.step):
                failure = self.heartbeats.peer_failure()
                if failure is not None:
                    self._follow(failure)
            limit, last = step_limit(self.timeout_s, self._intervals), self._last_step_at
            idle = time.monotonic() - last if last is not None else 0.0
            standing_aside = self._paused or preemption_flag().signum
            if limit is not None and last is not None and idle > limit and not standing_aside:
                self._give_up(limit=limit, idle=idle)

    def _give_up(self, *, limit: float, idle: float) -> None:
        if not self._reporting.acquire(blocking=False):
            return  # this rank is already reporting a failure
        log = get_logger()
        log.error(
            f"step watchdog (rank {self.rank}): no step finished for {idle:.1f} s (limit {limit:.0f} s) "
            f"after step {self.step}; stacks of this rank's threads follow, then a roll call of the ranks"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        call = None
        if self.heartbeats is not None:
            self.heartbeats.activity = f"its own watchdog report, stuck before in {main_thread_location()}"
            call = self.heartbeats.roll_call(step=self.step)
            log.error(f"step watchdog (rank {self.rank}): roll call:\n{call.describe()}")
        lost = self._lost_nodes(call) if call is not None else []
        self._await_informed_peers(call)
        record = {"reason": "hung", "step": self.step, "idle_s": round(idle, 1), "by_rank": self.rank,
                  "silent_ranks": call.silent if call else [], "lost_nodes": lost, "signal": None}  # fmt: skip
        self._write_marker(record)
        log.error(
            f"step watchdog (rank {self.rank}): exiting with {REQUEUE_EXIT_CODE}: the job is requeued "
            "and resumes from its last committed checkpoint"
        )
        self._depart(call)
        self._exit(REQUEUE_EXIT_CODE)

    def _follow(self, failure: dict[str, Any]) -> None:
        """Another rank stopped on an error while this one trains on, most likely blocked in a
        collective that waits for it: report as that rank does and end the process."""
        assert self.heartbeats is not None
        if not self._reporting.acquire(blocking=False):
            return  # this rank is already reporting (its own error, or a hang)
        where = main_thread_location()
        self.heartbeats.activity = f"its report on rank {failure['rank']}'s error, waiting before in {where}"
        call = self.heartbeats.roll_call(step=self.step)
        what = (
            f"rank {self.rank}: rank {failure['rank']} stopped on an error after step {failure['step']} "
            f"({failure['error']}) while this rank, after step {self.step}, waited in {where}; roll call of "
            f"the ranks:\n{call.describe()}"
        )
        if self._requeue_if_nodes_lost(call, what=what, error=failure["error"]):
            return
        get_logger().error(f"{what}\n{RESUBMIT}")
        self._depart(call)
        self._exit(1)

    def _lost_nodes(self, call: RollCall) -> list[str]:
        """The hosts none of whose ranks answered (when every silent rank is on one of them), or
        the store's host when the store did not answer at all (a refusal: its process ended)."""
        if call.store_unresponsive:
            return [f"{os.environ.get('MASTER_ADDR', 'the host')} (the rendezvous store's host)"]
        return [] if call.store_error else call.lost_nodes

    def _requeue_if_nodes_lost(self, call: RollCall, *, what: str, error: str) -> bool:
        """A whole node gone is no fault of the run: requeue (exit REQUEUE_EXIT_CODE), as for a hang.
        False when no node is lost (a simulated rank's `exit` returns: True, it has exited)."""
        lost = self._lost_nodes(call)
        if not lost:
            return False
        self._await_informed_peers(call)
        record = {"reason": "lost_node", "step": self.step, "by_rank": self.rank, "silent_ranks": call.silent,
                  "lost_nodes": lost, "error": error, "signal": None}  # fmt: skip
        self._write_marker(record)
        get_logger().error(
            f"{what}\nno rank on {', '.join(lost)} answers: the node is lost, not a rank's own failure; "
            f"exiting with {REQUEUE_EXIT_CODE}: the job is requeued and resumes from its last committed checkpoint"
        )
        self._depart(call)
        self._exit(REQUEUE_EXIT_CODE)
        return True

    def _await_informed_peers(self, call: RollCall | None) -> None:
        """After a roll call that could not reach the store: give the ranks that can reach it the
        time to report and to write the requeue marker (theirs names the silent ranks), then leave."""
        if call is None or not call.store_error:
            return
        deadline = time.monotonic() + UNINFORMED_INTERVALS * self.interval_s
        while time.monotonic() < deadline and not requeue_marker_path(self.run_dir).exists():
            time.sleep(min(self.interval_s, max(0.0, deadline - time.monotonic())))
        if requeue_marker_path(self.run_dir).exists():  # theirs: their reports are out, they are leaving
            time.sleep(DEPART_INTERVALS * self.interval_s)

    def _depart(self, call: RollCall | None) -> None:
        if call is not None and self.heartbeats is not None and not call.store_error:
            self.heartbeats.depart(call.answered, timeout_s=DEPART_INTERVALS * self.interval_s)

    def _write_marker(self, record: dict) -> None:
        try:  # every survivor writes it (under srun the first to exit ends the others); the first stays
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if requeue_marker_path(self.run_dir).exists():
                return  # a peer's report, made while this rank was the stuck one (SIGCONT by the launcher)
            write_requeue_marker(self.run_dir, record, writer=self.rank)
        except OSError as e:
            get_logger().error(f"step watchdog: could not write the requeue marker in {self.run_dir}: {e}")

    def explain_failure(self, error: BaseException) -> RollCall | None:
        """After a collective failed: log which ranks stopped answering (a roll call, seconds)."""
        self.close()
        if self.heartbeats is None:
            return None
        if not self._reporting.acquire(blocking=False):  # the watchdog reports and ends the process:
            # its roll call, its wait for the others, and rank 0's last interval for their store calls
            time.sleep((ROLL_CALL_INTERVALS + DEPART_INTERVALS + 1) * self.interval_s)
            return None
        self.heartbeats.announce_failure(step=self.step, error=describe_error(error))
        self.heartbeats.activity = f"the {type(error).__name__} of a failed collective"
        call = self.heartbeats.roll_call(step=self.step)
        what = (
            f"rank {self.rank}: a collective failed after step {self.step} ({describe_error(error)}); "
            f"roll call of the ranks:\n{call.describe()}"
        )
        if not self._requeue_if_nodes_lost(call, what=what, error=describe_error(error)):
            get_logger().error(f"{what}\n{RESUBMIT}")
            self._depart(call)
        return call
