"""Which failures the step watchdog calls a lost node (requeue) rather than a rank's own (fail): the
member list each rank joins under its host, against a roll call's silent ranks, on a real TCPStore;
and a store that stops answering, which torch's client would wait on for ever. Across real nodes:
tests/test_slurm_two_nodes_faults.py (killed_node); at 64 and 1024 ranks:
tests/test_watchdog_roll_call.py, benchmarks/scale_store.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.store_sim import QUICK_RESOLVER, SERVER, freeze

from bigclip.distributed import store_client
from bigclip.train.bounded_store import BoundedStore, StoreUnresponsive
from bigclip.train.heartbeats import Heartbeats, RollCall
from bigclip.train.watchdog import StepWatchdog

HOSTS = ["node0", "node0", "node1", "node1"]


@pytest.fixture(scope="module")
def server():
    """A TCPStore server in a process of its own (the tests stop it)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **QUICK_RESOLVER})  # fmt: skip
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


# Generous: connecting is not what these tests measure, and a loaded 2-core machine (this file beside
# the Slurm fixtures) once took over 5 s to accept a connection on 127.0.0.1.
def _beats(port: int, hosts: list[str], *, prefix: str, deadline_s: float = 30.0) -> list[Heartbeats]:
    beats = []
    for rank, host in enumerate(hosts):
        store = BoundedStore(lambda: store_client("127.0.0.1", port, prefix=prefix, timeout_s=deadline_s),
                             deadline_s=deadline_s)  # fmt: skip
        beats.append(Heartbeats(store, rank=rank, world_size=len(hosts), interval_s=1.0, host=host))
        assert beats[-1].start()
    return beats


def _silent(beats: list[Heartbeats], silent: list[int]) -> list[str]:
    me = beats[0]
    return me._lost_hosts(silent, me._beats(silent))


def test_only_whole_silent_nodes_are_lost(server) -> None:
    beats = _beats(server[1], HOSTS, prefix="two-nodes")
    assert _silent(beats, [2, 3]) == ["node1"]
    assert _silent(beats, [3]) == []  # rank 2 answers: rank 3's own failure
    assert _silent(beats, [1, 2, 3]) == []  # rank 1 beside rank 0, which answers: its own
    assert _silent(beats, []) == []
    one_host = _beats(server[1], ["box"] * 4, prefix="one-host")
    assert one_host[0]._lost_hosts([1, 2, 3], one_host[0]._beats([1, 2, 3])) == []


def test_a_store_that_does_not_answer_is_the_store_hosts_node_lost_a_refusal_is_not(tmp_path: Path) -> None:
    dog = StepWatchdog(timeout_s=15, rank=0, run_dir=tmp_path, heartbeats=None)
    frozen = RollCall(4, silent=[2, 3], store_error="StoreUnresponsive: no answer", store_unresponsive=True)
    assert "the rendezvous store's host" in dog._lost_nodes(frozen)[0]
    assert dog._lost_nodes(RollCall(4, silent=[2, 3], lost_nodes=["node1"], store_error="Broken pipe")) == []
    assert dog._lost_nodes(RollCall(4, silent=[2, 3], lost_nodes=["node1"])) == ["node1"]


def test_a_stopped_store_bounds_every_call_and_a_fresh_connection_resumes(server) -> None:
    """torch's client waits for ever on a stopped server (add, check, get); the bounded store
    gives up after its deadline, and once the server runs again the next call connects afresh."""
    proc, port = server
    store = BoundedStore(
        lambda: store_client("127.0.0.1", port, prefix="stopped", timeout_s=2.0), deadline_s=2.0
    )
    assert store.add("n", 1) == 1
    freeze(proc.pid)  # every thread stopped, the store's event loop included
    try:
        for call in (lambda: store.add("n", 0), lambda: store.check(["n"]), lambda: store.get("n")):
            started = time.monotonic()
            with pytest.raises(StoreUnresponsive):
                call()
            assert time.monotonic() - started < 2.0 + 5.0  # the deadline, and a loaded box's slack
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    time.sleep(0.5)
    # the abandoned requests are served late on their own connections; this one's answers are its own
    assert store.add("n", 0) == 1
    assert bytes(store.get("n")) == b"1"
