"""Which ranks still answer: heartbeats in a store beside the process group, and a roll call.

Every rank's watchdog thread writes a beat every `interval_s` into the side store
(distributed.side_store: the rendezvous store, through a client with a short timeout), under its
rank: a counter, its last finished step, and where its main thread is at that moment. A rank that
stops beating is stopped (SIGSTOP, a frozen node), dead (killed, out of memory, its node lost) or
stuck holding the GIL; one that beats but finishes no step is waiting, usually in a collective,
for one of the first kind. A roll call reads every rank's beat twice, a few intervals apart,
beating itself meanwhile: who did not move did not answer. No collective is involved, so a hung
process group cannot hang the diagnosis, and a store that does not answer (its host is rank 0
under srun) is reported as such. A rank whose training stops on an error announces it in the same
store: its peers may be blocked in a collective that waits for it, which they would otherwise
notice only when its process exits (gloo) or at the process group's timeout (NCCL). Cost: one
small store write and one key check per rank per interval, off the training thread.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

ROLL_CALL_INTERVALS = 2.5  # a live rank beats at least twice in this many intervals
FAILURE_KEY = "failed"


@dataclass(frozen=True)
class Beat:
    count: int
    step: int
    where: str


@dataclass
class RollCall:
    world_size: int
    silent: list[int] = field(default_factory=list)  # ranks that did not beat during the call
    beats: dict[int, Beat] = field(default_factory=dict)  # the latest beat of every rank that beat
    store_error: str = ""  # the store itself did not answer

    def describe(self) -> str:
        if self.store_error:
            return (
                f"the rendezvous store does not answer ({self.store_error}): the process hosting it "
                "(rank 0 under srun, the first node's torchrun) is stopped, frozen or dead"
            )
        lines = []
        if self.silent:
            lines.append(f"not answering (stopped, frozen, dead or its node lost): ranks {self.silent}")
        else:
            lines.append(f"all {self.world_size} ranks answer: one is stuck, not stopped (see their stacks)")
        for rank in sorted(self.beats):
            beat, state = self.beats[rank], "SILENT, last seen" if rank in self.silent else "answering,"
            lines.append(f"  rank {rank}: {state} after step {beat.step} in {beat.where}")
        lines += [f"  rank {r}: never beat" for r in self.silent if r not in self.beats]
        return "\n".join(lines)


def main_thread_location() -> str:
    """Where the main thread is: its innermost frame, and the innermost bigclip frame above it."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame, limit=60)  # a snapshot: the frame keeps running
    inner = _frame_text(stack[-1])
    ours = next((_frame_text(f) for f in reversed(stack) if "/bigclip/" in f.filename), inner)
    return inner if ours == inner else f"{inner}, called from {ours}"


def _frame_text(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    if "/site-packages/" in path:
        path = path.split("/site-packages/", 1)[1]
    elif "/bigclip/" in path:
        path = "bigclip/" + path.split("/bigclip/", 1)[1]
    return f"{frame.name} ({path}:{frame.lineno})"


def describe_error(error: BaseException) -> str:
    first = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{type(error).__name__}: {first}"


class Heartbeats:
    """This rank's beats and roll calls in `store` (a distributed.side_store)."""

    def __init__(self, store: Any, *, rank: int, world_size: int, interval_s: float) -> None:
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self.activity = ""  # what to report instead of the main thread's place (e.g. "handling an error")
        self._count = 0
        self._lock = threading.Lock()

    def beat(self, step: int) -> None:
        with self._lock:
            self._count += 1
            where = self.activity or main_thread_location()
            value = json.dumps({"count": self._count, "step": step, "where": where})
            # A timeout or a refused connection: the store's host is gone, which a roll call reports.
            with contextlib.suppress(Exception):
                self.store.set(str(self.rank), value)

    def announce_failure(self, *, step: int, error: str) -> None:
        """Tell every rank's watchdog that this rank stopped on `error` after `step`."""
        with contextlib.suppress(Exception):  # nobody can be told: the peers fall back on their own errors
            self.store.set(FAILURE_KEY, json.dumps({"rank": self.rank, "step": step, "error": error}))

    def peer_failure(self) -> dict[str, Any] | None:
        """The failure another rank announced, if any (None too when the store does not answer)."""
        try:
            if not self.store.check([FAILURE_KEY]):
                return None
            failure = json.loads(bytes(self.store.get(FAILURE_KEY)).decode())
        except Exception:
            return None
        return failure if failure["rank"] != self.rank else None

    def read(self) -> dict[int, Beat]:
        """The latest beat of every rank that has beaten (raises if the store does not answer)."""
        keys = [str(r) for r in range(self.world_size)]
        if not self.store.check(keys):  # someone never beat: ask one by one, never wait for a key
            keys = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(keys) if keys else []
        return {int(k): Beat(**json.loads(bytes(v).decode())) for k, v in zip(keys, values)}

    def roll_call(self, *, step: int) -> RollCall:
        call = RollCall(self.world_size)
        try:
            before = self.read()
            deadline = time.monotonic() + ROLL_CALL_INTERVALS * self.interval_s
            while time.monotonic() < deadline:  # keep answering others' roll calls meanwhile
                time.sleep(min(self.interval_s, max(0.0, deadline - time.monotonic())))
                self.beat(step)
            call.beats = self.read()
        except Exception as e:
            call.store_error = describe_error(e)
            return call
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            now, then = call.beats.get(rank), before.get(rank)
            if now is None or (then is not None and now.count == then.count):
                call.silent.append(rank)
        return call

    def depart(self, answering: list[int], *, step: int, timeout_s: float) -> None:
        """Leave together: wait (bounded, still beating) until every answering rank has finished its
        own roll call, so a launcher that kills the rest when one exits (srun --kill-on-bad-exit)
        cuts no report short, and rank 0, which may host the store, does not take it away mid-call."""
        try:
            self.store.set(f"left/{self.rank}", "1")
            others = [f"left/{r}" for r in answering if r != self.rank]
            deadline = time.monotonic() + timeout_s
            next_beat = time.monotonic() + self.interval_s
            while others and not self.store.check(others) and time.monotonic() < deadline:
                time.sleep(0.2)
                if time.monotonic() >= next_beat:
                    self.beat(step)
                    next_beat += self.interval_s
            if self.rank == 0:
                time.sleep(min(2.0, self.interval_s))  # the others' last store calls
        except Exception:
            pass  # the store is gone: nobody is left to wait for
