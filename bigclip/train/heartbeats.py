"""Which ranks still answer: heartbeats in a store beside the process group, and a roll call whose
cost per rank does not grow with the world.

Every rank's watchdog thread writes a beat every `interval_s` into the side store (the rendezvous
store through a connection of its own, each call bounded: bounded_store.py): a counter, its last
finished step, its host, and where its main thread is at that moment. In the same interval it
reads one counter, the roll call, which is 0 while all is well. A rank that suspects a hang or sees
a collective fail opens the roll call (adds 1; the first to do so is its caller); every rank whose
watchdog still runs answers at its next beat by appending its rank to one key. ROLL_CALL_INTERVALS
later the caller reads that key once: a rank that did not answer is stopped (SIGSTOP, a frozen
node), dead (killed, out of memory, its node lost) or stuck holding the GIL; one that answers but
finishes no step is waiting, usually in a collective, for one of the first kind. The caller also
reads the last beats of the silent ranks (where they were), the member lists of their hosts (a
host none of whose ranks answers is a lost node) and every answering rank's beat (grouped by where
they are, for its report), and publishes the verdict; the other ranks read the verdict (or, if the
caller stopped meanwhile, the answers themselves). No collective is involved, so a hung process
group cannot hang the diagnosis, and a store that does not answer (its host is rank 0 under srun)
is reported as such.

Cost per rank, whatever the world size: two store requests per interval (a beat, the counter), a
fixed dozen for a roll call and the wait to leave together (a counter and one wait on the server,
not a poll), and bytes in proportion to the silent ranks; the caller alone reads O(world) bytes.
tests/test_watchdog_roll_call.py counts them at 16 and 64 ranks on a real TCPStore, and
benchmarks/scale_store.py runs 1024 ranks' watchdogs against one.

A rank whose training stops on an error announces it in the same store: its peers may be blocked
in a collective that waits for it, which they would otherwise notice only when its process exits
(gloo) or at the process group's timeout (NCCL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from bigclip.train.bounded_store import StoreUnresponsive

ROLL_CALL_INTERVALS = 2.5  # a live rank beats, and so answers, at least twice in this many intervals
EXTRA_INTERVALS = 4  # ... the caller waits up to this much longer while answers still arrive
WINDOW_INTERVALS = ROLL_CALL_INTERVALS + EXTRA_INTERVALS
STORE_ATTEMPTS = 2  # a store that stopped answering for a while gets a second connection
FAILURE_KEY = "failed"
CALL_KEY = "call"  # a counter: > 0 once a roll call is open
PRESENT_KEY = "present"  # "R," appended by every rank answering the roll call
ANSWERS_KEY = "answers"  # ... and a counter of them, which the caller watches
MEMBERS_KEY = "members"  # MEMBERS_KEY/HOST: "R," appended by every rank on HOST at start
STARTED_KEY = "started"  # "R," appended by every rank after its first beat: the beats one can read
VERDICT_KEY = "verdict"  # the opening rank's reading: silent ranks, their last beats, lost hosts
VERDICT_WAIT_INTERVALS = EXTRA_INTERVALS + 3  # after its own window: how long to wait for the verdict
LEFT_KEY, DEPARTED_KEY = "left", "departed"
MAX_LISTED = 64  # silent ranks described one per line; the rest are counted


@dataclass(frozen=True)
class Beat:
    count: int
    step: int
    where: str
    host: str = ""


@dataclass
class RollCall:
    world_size: int
    silent: list[int] = field(default_factory=list)  # ranks that did not answer the call
    beats: dict[int, Beat] = field(default_factory=dict)  # the last beats of the silent ranks that beat
    answering: list[tuple[list[int], Beat]] = field(default_factory=list)  # the caller's: grouped by place
    answered: int = 0
    caller: int = -1  # the rank that opened the call: it read every answer, and lists where each one is
    lost_nodes: list[str] = field(default_factory=list)  # hosts none of whose ranks answered
    store_error: str = ""  # the store itself did not answer
    store_unresponsive: bool = False  # ... no answer at all (its host stopped or cut off), not a refusal

    def describe(self) -> str:
        if self.store_error:
            state = "stopped, frozen or cut off" if self.store_unresponsive else "gone (its process ended)"
            return (
                f"the rendezvous store does not answer ({self.store_error}): the process hosting it "
                f"(rank 0 under srun, the first node's torchrun) is {state}"
            )
        lines = []
        if self.silent:
            lines.append(f"not answering (stopped, frozen, dead or its node lost): ranks {self.silent}")
        else:
            lines.append(f"all {self.world_size} ranks answer: one is stuck, not stopped (see their stacks)")
        for rank in self.silent[:MAX_LISTED]:
            beat = self.beats.get(rank)
            on = f" on {beat.host}" if beat and beat.host else ""
            seen = f"last seen after step {beat.step} in {beat.where}" if beat else "never beat"
            lines.append(f"  rank {rank}: SILENT, {seen}{on}")
        if len(self.silent) > MAX_LISTED:
            lines.append(f"  ... and {len(self.silent) - MAX_LISTED} more silent ranks")
        if self.lost_nodes:
            lines.append(f"  no rank on {', '.join(self.lost_nodes)} answers: the node is lost")
        for ranks, beat in self.answering:
            lines.append(f"  {rank_ranges(ranks)}: answering, after step {beat.step} in {beat.where}")
        if self.answered and not self.answering:
            lines.append(
                f"  {self.answered} ranks answer (rank {self.caller}'s report says where each one is)"
            )
        return "\n".join(lines)


def rank_ranges(ranks: list[int]) -> str:
    """'rank 3', or 'ranks 0-5, 7 (7 ranks)' for sorted `ranks`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs = itertools.groupby(enumerate(ranks), lambda pair: pair[1] - pair[0])  # constant along a run
    spans = [[rank for _, rank in run] for _, run in runs]
    text = ", ".join(f"{span[0]}-{span[-1]}" if len(span) > 1 else f"{span[0]}" for span in spans)
    return f"ranks {text} ({len(ranks)} ranks)"


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


def _ranks(value: bytes) -> set[int]:
    return {int(r) for r in bytes(value).decode().split(",") if r}


class Heartbeats:
    """This rank's beats and roll calls in `store` (a BoundedStore over distributed.side_store)."""

    def __init__(self, store: Any, *, rank: int, world_size: int, interval_s: float, host: str = "") -> None:
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self.host = host or socket.gethostname()
        self.activity = ""  # what to report instead of the main thread's place (e.g. "handling an error")
        self._count = 0
        self._answered = False
        self._lock = threading.Lock()

    def start(self) -> bool:
        """Join this host's member list, beat, then the list of started ranks: a started rank has a
        beat and its host's list (one connection, so the store sees them in this order). False if
        the store did not answer (no list: a failure is then never a lost node)."""
        try:
            self.store.append(f"{MEMBERS_KEY}/{self.host}", f"{self.rank},")
            self._beat(0)
            self.store.append(STARTED_KEY, f"{self.rank},")
            return True
        except Exception:
            return False

    def beat(self, step: int) -> bool:
        """Write this rank's beat and answer an open roll call; True while one is open."""
        try:  # a timeout or a refused connection: the store's host is gone, which a roll call reports
            return self._beat(step)
        except Exception:
            return False

    def _beat(self, step: int) -> bool:
        with self._lock:
            self._count += 1
            where = self.activity or main_thread_location()
            value = json.dumps({"count": self._count, "step": step, "where": where, "host": self.host})
            self.store.set(str(self.rank), value)
            called = self.store.add(CALL_KEY, 0) > 0
            if called and not self._answered:
                self.store.append(PRESENT_KEY, f"{self.rank},")
                self.store.add(ANSWERS_KEY, 1)
                self._answered = True
            return called

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

    def roll_call(self, *, step: int) -> RollCall:
        """Open (or join) the roll call, answer it, wait for the others' answers; the rank that
        opened it reads them and publishes the verdict, the others read that (O(silent) bytes)."""
        call = RollCall(self.world_size)
        try:
            opened = self._retried(lambda: self.store.add(CALL_KEY, 1)) == 1
            self.beat(step)  # this rank's own answer
            self._await_answers(step, opened=opened)
            if opened:
                self._retried(lambda: self._read_answers(call))
                self.store.set(VERDICT_KEY, _verdict_text(call))
            else:
                self._retried(lambda: self._read_verdict(call))
        except Exception as e:
            call.store_error = describe_error(e)
            call.store_unresponsive = isinstance(e, StoreUnresponsive)
        return call

    def _await_answers(self, step: int, *, opened: bool) -> None:
        """Beat (so answer others' calls) through the window; the caller extends it, an interval at
        a time up to EXTRA_INTERVALS, while answers still came in over the last interval (ranks
        whose watchdog threads were slow to run: answers that trickle in are live ranks)."""
        start = time.monotonic()
        end = start + ROLL_CALL_INTERVALS * self.interval_s
        latest = start + WINDOW_INTERVALS * self.interval_s
        counts: list[tuple[float, int]] = []  # the caller's (time, answers so far)
        while True:
            now = time.monotonic()
            if now >= end:
                if not (opened and now < latest and self._arriving(counts, now)):
                    return
                end = min(latest, now + self.interval_s)
            time.sleep(min(self.interval_s, end - now))
            self.beat(step)
            if opened:
                with contextlib.suppress(Exception):  # no count: no extension
                    counts.append((time.monotonic(), self.store.add(ANSWERS_KEY, 0)))

    def _arriving(self, counts: list[tuple[float, int]], now: float) -> bool:
        """More answers now than an interval ago."""
        before = [n for t, n in counts if t <= now - self.interval_s]
        return bool(counts and before) and counts[-1][1] > before[-1]

    def _retried(self, step: Any) -> Any:
        """A store stopped for a while (or too busy to answer in time): once more, connected afresh.
        A request repeated this way may have been served twice (an add, an append): the counters
        and lists read here tolerate it."""
        for attempt in range(STORE_ATTEMPTS):
            try:
                return step()
            except StoreUnresponsive:
                if attempt == STORE_ATTEMPTS - 1:
                    raise

    def _read_answers(self, call: RollCall) -> None:
        """Who answered, the last beats of the silent, their hosts' members; where the answering
        ranks are, grouped. O(world) bytes: the opening rank's alone."""
        present, started = (_ranks(v) for v in self.store.multi_get([PRESENT_KEY, STARTED_KEY]))
        call.silent = [r for r in range(self.world_size) if r not in present]
        call.answered, call.caller = len(present), self.rank
        call.beats = self._beats([r for r in call.silent if r in started])
        call.lost_nodes = self._lost_hosts(call.silent, call.beats)
        call.answering = _grouped(self._beats(sorted(present)))

    def _read_verdict(self, call: RollCall) -> None:
        """The opening rank's verdict, or (it did not come: that rank stopped or died meanwhile)
        this rank's own reading of the answers."""
        try:
            self.store.wait([VERDICT_KEY], VERDICT_WAIT_INTERVALS * self.interval_s)
        except StoreUnresponsive:
            raise
        except Exception:  # the wait timed out: this rank reads what the caller would have
            return self._read_answers(call)
        verdict = json.loads(bytes(self.store.get(VERDICT_KEY)).decode())
        call.caller, call.silent, call.answered = verdict["caller"], verdict["silent"], verdict["answered"]
        call.beats = {int(r): Beat(**b) for r, b in verdict["beats"].items()}
        call.lost_nodes = verdict["lost"]

    def _beats(self, ranks: list[int]) -> dict[int, Beat]:
        """The last beats of `ranks` (started ranks: multi_get would wait for a missing key)."""
        keys = [str(r) for r in ranks]
        values = self.store.multi_get(keys) if keys else []
        return {int(k): Beat(**json.loads(bytes(v).decode())) for k, v in zip(keys, values)}

    def _lost_hosts(self, silent: list[int], beats: dict[int, Beat]) -> list[str]:
        """The hosts none of whose ranks answered, if every silent rank is on one of them."""
        if not silent or any(r not in beats or not beats[r].host for r in silent):
            return []  # a rank of unknown host is silent: not (only) a lost node
        hosts = sorted({beats[r].host for r in silent})
        members = self.store.multi_get([f"{MEMBERS_KEY}/{h}" for h in hosts])  # listed before the first beat
        quiet = set(silent)
        lost = [h for h, ranks in zip(hosts, members) if _ranks(ranks) <= quiet]
        return lost if len(lost) == len(hosts) else []

    def depart(self, answered: int, *, timeout_s: float) -> None:
        """Leave together: wait (bounded) until every answering rank has finished its own roll
        call, so a launcher that kills the rest when one exits (srun --kill-on-bad-exit) cuts no
        report short, and rank 0, which may host the store, does not take it away mid-call. A
        counter and one wait on the server, not a poll: the last rank to leave releases the rest."""
        try:
            if self.store.add(LEFT_KEY, 1) >= answered:
                self.store.set(DEPARTED_KEY, "1")
            else:
                self.store.wait([DEPARTED_KEY], timeout_s)
        except Exception:
            pass  # the store is gone, or some rank did not come: nobody is left to wait for
        if self.rank == 0:
            time.sleep(min(2.0, self.interval_s))  # the others' last store calls


def _verdict_text(call: RollCall) -> str:
    beats = {str(r): dataclasses.asdict(b) for r, b in call.beats.items()}
    return json.dumps({"caller": call.caller, "silent": call.silent, "answered": call.answered, "beats": beats,
                       "lost": call.lost_nodes})  # fmt: skip


def _grouped(beats: dict[int, Beat]) -> list[tuple[list[int], Beat]]:
    """Answering ranks grouped by (step, where), the largest group first."""
    groups: dict[tuple[int, str], list[int]] = {}
    for rank in sorted(beats):
        groups.setdefault((beats[rank].step, beats[rank].where), []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    return [(ranks, beats[ranks[0]]) for _, ranks in ordered]
