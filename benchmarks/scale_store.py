"""The step watchdog's roll call at 64-1024 simulated ranks on one real TCPStore, beside the roll call
it replaced (issue 37, goal 5). Writes benchmarks/results/scale_store.json.

    python benchmarks/scale_store.py [--worlds 64 128 256 512 1024] [--hang]

Each world runs tests/support/store_sim.py: a real TCPStore server in its own process, real
StepWatchdogs and Heartbeats (64 ranks per client process, 8 ranks per host name), and one lost
node: its process SIGKILLed, after which every survivor's collective "fails" at once and it calls
`explain_failure`, as the training loop does (the whole world's roll calls at the same moment: the
store's worst load). Per world and protocol: how many survivors exited with the requeue code (85)
naming the lost node and no other rank, the seconds from the kill to the last exit, store requests
and bytes read per rank from its roll call's start to its exit (the caller, which reads every
answer, apart), and store errors. `old` is the pre-#37 protocol (tests/support/legacy_heartbeats.py:
every rank read all W beats twice and polled W keys to leave). `--hang` adds the frozen-node case at
the largest world: the lost node SIGSTOPped and the survivors' step timeout (100 s) running out.
The beat interval is a twentieth of the step timeout, at most 5 s: the auto step timeout's (at
least 300 s) at 1024 GPUs. Also measured: the round trips each TCPStore call takes (through a
relay that counts request/answer turns), whatever the number of keys.

`measure(worlds)` returns the rows (benchmarks/scale_sim.py imports it). On a 2-core box the 1024
simulated ranks share two cores with the store: the seconds are an upper bound for a cluster, where
each rank has its own.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.store_sim import Result, Scenario, simulate  # noqa: E402

from benchmarks.common import print_table, write_results  # noqa: E402

WORLDS = [64, 128, 256, 512, 1024]
STEP_TIMEOUT_S = 100.0  # beats every 5 s, as at the auto step timeout
COLUMNS = ["world", "protocol", "fault", "named and requeued", "seconds to the last exit", "requests per rank",
           "bytes per rank", "caller bytes", "store_errors"]  # fmt: skip


def row(result: Result) -> dict[str, Any]:
    s = result.scenario
    exits = list(result.exits.values())
    survivors = s.world - len(s.lost_ranks)
    named = [e for e in exits if e.silent == s.lost_ranks and e.lost_nodes == [f"node{s.lost_node}"]]
    others = [e for e in exits if not e.report] or exits
    callers = [e for e in exits if e.report]
    return {  # the first eight: the docs' table
        "world": s.world,
        "protocol": s.protocol,
        "fault": {"kill": "killed", "stop": f"frozen, step timeout {s.step_timeout_s:.0f} s"}[s.fault],
        "named and requeued": f"{sum(e.code == 85 and e in named for e in exits)}/{survivors}",
        "seconds to the last exit": round(max((e.seconds for e in exits), default=float("nan")), 1),
        "requests per rank": statistics.median(e.requests for e in others) if others else None,
        "bytes per rank": statistics.median(e.bytes_read for e in others) if others else None,
        "caller bytes": max((e.bytes_read for e in callers), default=None),
        "requeued": sum(e.code == 85 for e in exits),
        "named": len(named),
        "requests_max": max((e.requests for e in exits), default=None),
        "total_bytes": sum(e.bytes_read for e in exits),
        "store_errors": sum(bool(e.store_error) for e in exits),
        "never_exited": len(result.missing),
        "start_s": round(result.start_s, 1),
        "step_timeout_s": s.step_timeout_s,
    }


def measure(worlds: list[int] = WORLDS, *, protocols: tuple[str, ...] = ("new", "old"),
            step_timeout_s: float = STEP_TIMEOUT_S) -> list[dict[str, Any]]:  # fmt: skip
    """One row per world and protocol: the kill scenario (see the module docstring)."""
    rows = []
    for world in worlds:
        for protocol in protocols:
            rows.append(
                row(simulate(Scenario(world=world, protocol=protocol, step_timeout_s=step_timeout_s)))
            )
            print_table(rows[-1:], COLUMNS)
    return rows


def round_trips() -> dict[str, int]:
    """Request/answer turns of each TCPStore call, counted by a relay between client and server."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    relay = _Relay(server.port)
    client = dist.TCPStore("127.0.0.1", relay.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))  # fmt: skip
    keys = [str(i) for i in range(1024)]
    server.multi_set(keys, ["x" * 100] * len(keys))
    calls = {
        "set": lambda: client.set("a", "1"), "append": lambda: client.append("p", "1,"),
        "add": lambda: client.add("c", 1), "check (1 key)": lambda: client.check(["a"]),
        "check (1024 keys)": lambda: client.check(keys), "get": lambda: client.get("a"),
        "multi_get (1024 keys)": lambda: client.multi_get(keys), "wait (present)": lambda: client.wait(["a"]),
    }  # fmt: skip
    return {name: relay.turns_of(call) for name, call in calls.items()}


class _Relay:
    """A TCP relay counting turns: runs of client bytes, each ended by the server's answer."""

    def __init__(self, upstream: int) -> None:
        self.upstream, self.turns, self.last = upstream, 0, ""
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def turns_of(self, call: Any) -> int:
        time.sleep(0.1)
        with self.lock:
            self.turns, self.last = 0, ""
        call()
        time.sleep(0.2)  # the last answer's bytes have passed
        return self.turns

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.upstream))
            for a, b, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pipe, args=(a, b, way), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, way: str) -> None:
        while data := _recv(a):
            with self.lock:
                self.turns += way == "up" and self.last != "up"
                self.last = way
            b.sendall(data)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=WORLDS)
    parser.add_argument("--hang", action="store_true", help="add the frozen node at the largest world")
    args = parser.parse_args()
    turns = round_trips()
    print_table([{"call": k, "round trips": v} for k, v in turns.items()])
    rows = measure(args.worlds)
    if args.hang:
        scenario = Scenario(world=max(args.worlds), fault="stop", step_timeout_s=STEP_TIMEOUT_S)
        rows.append(row(simulate(scenario, deadline_s=STEP_TIMEOUT_S + 300)))
        print_table(rows[-1:], COLUMNS)
    print_table(rows, COLUMNS)
    load = os.getloadavg()[0]
    write_results("scale_store", rows, round_trips=turns, load_average=round(load, 1), cpus=os.cpu_count())


if __name__ == "__main__":
    main()
