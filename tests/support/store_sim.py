"""Many ranks' step watchdogs against one real TCPStore: the harness of tests/test_watchdog_roll_call.py
and benchmarks/scale_store.py.

    result = simulate(Scenario(world=1024, fault="kill"))    # per-rank exit codes, times, store calls

The store's server is a real `torch.distributed.TCPStore` in a process of its own (as rank 0's
store thread is under srun; the harness can SIGSTOP it). A node is `ranks_per_node` ranks on one
host name; a client process holds whole nodes, up to `ranks_per_process` ranks, each a real
StepWatchdog with real Heartbeats over its own TCPStore connection (bigclip.distributed.store_client
through a BoundedStore), in threads. The lost node is a process of its own. Faults:
  kill   SIGKILL the lost node's process (every connection of its ranks resets); every survivor's
         collective fails at once and it calls StepWatchdog.explain_failure, as the training loop
         does: the store sees the load of a whole world's roll calls at once.
  stop   SIGSTOP it (a frozen node): the survivors finish no step, and each watchdog reports when
         its step timeout runs out (the `hung` verdict).
`store_stop_s` also stops the store's process that long right after the fault (a store too slow
to answer). What each survivor did comes back as an Exit: the code it exited with (85: requeue;
1: a roll call returned without finding a lost node), when, and the store requests, bytes and
verdict of its roll call (requests counted from its roll call's start to its exit: the wait to
leave together included). `protocol` runs another roll call in the same set-up (the benchmark's
pre-#37 code, support/legacy_heartbeats.py).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

SERVER = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""
PREFIX = "bigclip/heartbeats/0"
# torch's TCPStore looks up the host name of every peer it connects to or accepts, the server's
# in its one event-loop thread: a resolver that drops a lookup stalls every client for its timeout
# (glibc's default: 5 s; a few percent of loopback lookups on some sandboxes). One short try.
QUICK_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}
CONNECTING = 8  # connections a client process makes at once
FAILURE = "RuntimeError: [gloo/transport/tcp/pair.cc] Connection closed by peer"


@dataclass(frozen=True)
class Scenario:
    world: int
    fault: str = "kill"  # or "stop"
    ranks_per_node: int = 8
    ranks_per_process: int = 64
    lost_node: int = 1
    step_timeout_s: float = 20.0  # the watchdog's interval is a twentieth: 1 s
    store_stop_s: float = 0.0
    protocol: str = "new"  # "old": support/legacy_heartbeats.py

    @property
    def lost_ranks(self) -> list[int]:
        first = self.lost_node * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))


@dataclass
class Exit:
    rank: int
    code: int
    seconds: float  # from the fault
    requests: int  # store requests from the roll call's start to the exit
    bytes_read: int
    silent: list[int]
    lost_nodes: list[str]
    store_error: str
    report: str  # the reporter's roll call, as logged


@dataclass
class Result:
    scenario: Scenario
    exits: dict[int, Exit] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)  # survivors that had not exited by the deadline
    start_s: float = 0.0  # connecting every client and the first beats

    @property
    def codes(self) -> set[int]:
        return {e.code for e in self.exits.values()}


def simulate(scenario: Scenario, *, deadline_s: float = 300) -> Result:
    """Run the scenario; every process it started is gone when it returns."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "bigclip.train.watchdog"])
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **QUICK_RESOLVER})  # fmt: skip
    nodes: list[Any] = []
    try:
        port = int(server.stdout.readline())
        with tempfile.TemporaryDirectory() as run_dir:
            return _run(ctx, scenario, port, server, nodes, Path(run_dir), deadline_s)
    finally:
        for p in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        server.kill()
        server.wait()


def _run(
    ctx: Any, s: Scenario, port: int, server: Any, nodes: list, run_dir: Path, deadline_s: float
) -> Result:
    results, go, fail = ctx.Queue(), ctx.Event(), ctx.Event()
    groups = _process_ranks(s)
    started = time.monotonic()
    for ranks in groups:
        nodes.append(
            ctx.Process(target=_node, args=(s, port, ranks, str(run_dir), results, go, fail), daemon=True)
        )
        nodes[-1].start()
    for _ in groups:
        kind, value = results.get(timeout=deadline_s)
        assert kind == "ready", value
    result = Result(s, start_s=time.monotonic() - started)
    go.set()
    time.sleep(1.5)  # every watchdog has started and beaten
    lost = nodes[0]
    os.kill(lost.pid, signal.SIGKILL if s.fault == "kill" else signal.SIGSTOP)
    fault_at = time.monotonic()
    if s.store_stop_s:
        freeze(server.pid)
    fail.set()
    if s.store_stop_s:
        time.sleep(s.store_stop_s)
        os.kill(server.pid, signal.SIGCONT)
    survivors = set(range(s.world)) - set(s.lost_ranks)
    end = fault_at + deadline_s
    while set(result.exits) < survivors and time.monotonic() < end:
        try:
            kind, value = results.get(timeout=max(0.1, end - time.monotonic()))
        except Exception:
            break
        if kind == "exit":
            value.seconds -= fault_at
            result.exits[value.rank] = value
    result.missing = sorted(survivors - set(result.exits))
    return result


def freeze(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP a process and return once every thread of it has stopped. kill() returns when the
    signal is queued: one thread takes it and only then stops the others, so on a loaded machine
    the store's event-loop thread could still answer a request sent just after kill()."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + timeout_s
    while not all(_stopped(task) for task in Path(f"/proc/{pid}/task").iterdir()):
        assert time.monotonic() < end, f"process {pid} did not stop within {timeout_s} s"
        time.sleep(0.01)


def _stopped(task: Path) -> bool:
    try:  # the state follows the parenthesised command name, which may hold spaces
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except FileNotFoundError:  # a thread that ended
        return True


def _process_ranks(s: Scenario) -> list[list[int]]:
    """The lost node alone first, then the other ranks in processes of whole nodes."""
    others = [r for r in range(s.world) if r not in s.lost_ranks]
    per = max(s.ranks_per_node, s.ranks_per_process // s.ranks_per_node * s.ranks_per_node)
    return [s.lost_ranks] + [others[i : i + per] for i in range(0, len(others), per)]


def _node(s: Scenario, port: int, ranks: list[int], run_dir: str, results: Any, go: Any, fail: Any) -> None:
    os.environ.update(QUICK_RESOLVER)  # before this process's first lookup
    import torch

    from bigclip.train.metrics import LOGGER_NAME

    torch.set_num_threads(1)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - every watchdog's stack dump
    logging.getLogger(LOGGER_NAME).setLevel(logging.CRITICAL)  # what matters comes back as an Exit
    make = partial(_legacy_rank if s.protocol == "old" else _rank, s, port, run_dir=run_dir, results=results)
    with ThreadPoolExecutor(CONNECTING) as pool:  # a connection may wait seconds on a reverse DNS lookup
        members = list(pool.map(make, ranks))
    results.put(("ready", len(ranks)))
    go.wait()
    for member in members:
        member.watch()
    # The lost node never waits on `fail`: a process killed while waiting on a multiprocessing
    # Event would leave its set() waiting for that sleeper's acknowledgement for ever.
    if s.fault == "kill" and ranks != s.lost_ranks:
        fail.wait()
        for member in members:
            threading.Thread(target=member.fail, daemon=True).start()
    threading.Event().wait()  # until the harness kills this process


class _Member:
    """One simulated rank: its watchdog, and how it reports back."""

    def __init__(self, s: Scenario, rank: int, results: Any, store: Any) -> None:
        self.s, self.rank, self.results, self.store = s, rank, results, store
        self.call: Any = None
        self.requests_at = self.bytes_at = 0
        self.done = threading.Lock()

    def counted(self, roll_call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(**kwargs: Any) -> Any:
            self.requests_at, self.bytes_at = self.store.requests, self.store.bytes_read
            self.call = roll_call(**kwargs)
            return self.call

        return wrapped

    def exited(self, code: int) -> None:
        if not self.done.acquire(blocking=False):
            raise SystemExit  # one exit per rank (a hang's report and a failure's may race)
        call = self.call
        report = call.describe() if call is not None and call.caller == self.rank else ""
        self.results.put(("exit", Exit(
            self.rank, code, time.monotonic(), self.store.requests - self.requests_at,
            self.store.bytes_read - self.bytes_at, list(call.silent) if call else [],
            list(call.lost_nodes) if call else [], call.store_error if call else "", report)))  # fmt: skip
        raise SystemExit  # ends this thread, as os._exit would end the process


def _client(port: int, prefix: str, timeout_s: float) -> Any:
    from bigclip.distributed import store_client

    return store_client("127.0.0.1", port, prefix=prefix, timeout_s=timeout_s)


class _Rank(_Member):
    def __init__(self, s: Scenario, port: int, rank: int, run_dir: str, results: Any) -> None:
        from bigclip.train.bounded_store import BoundedStore
        from bigclip.train.heartbeats import Heartbeats
        from bigclip.train.watchdog import StepWatchdog, beat_interval, store_deadline

        interval = beat_interval(s.step_timeout_s)
        deadline = store_deadline(interval)
        first = [_client(port, PREFIX, deadline)]  # however long it takes on a loaded box
        connect = partial(_client, port, PREFIX, deadline)
        store = BoundedStore(lambda: first.pop() if first else connect(), deadline_s=deadline)
        super().__init__(s, rank, results, store)
        self.beats = Heartbeats(store, rank=rank, world_size=s.world, interval_s=interval,
                                host=f"node{rank // s.ranks_per_node}")  # fmt: skip
        self.beats.roll_call = self.counted(self.beats.roll_call)
        while not self.beats.start():  # a connection may take long on a loaded box: every rank starts
            pass
        self.dog = StepWatchdog(timeout_s=s.step_timeout_s, rank=rank, run_dir=Path(run_dir),
                                heartbeats=self.beats, exit=self.exited)  # fmt: skip

    def watch(self) -> None:
        self.dog.step_done(0)  # the last step that finished: the hang starts now
        self.dog.start()

    def fail(self) -> None:
        self.dog.explain_failure(RuntimeError(FAILURE))  # returns when no node is lost: the loop raises
        self.exited(1)


def _rank(s: Scenario, port: int, rank: int, run_dir: str, results: Any) -> _Member:
    return _Rank(s, port, rank, run_dir, results)


def _legacy_rank(s: Scenario, port: int, rank: int, run_dir: str, results: Any) -> _Member:
    from support.legacy_heartbeats import LegacyRank

    return LegacyRank(s, port, rank, results, member=_Member, client=_client)
