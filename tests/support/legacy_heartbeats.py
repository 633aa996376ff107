"""The roll call bigclip had before issue 37 (bigclip/train/heartbeats.py and watchdog.py at 0c5acd8),
kept only so benchmarks/scale_store.py can run it beside the current one on the same harness
(support/store_sim.py, `protocol="old"`). Not used by bigclip.

Each rank read every rank's beat twice (a check of all W keys, then a multi_get of all W), 2.5
intervals apart, beating meanwhile; read every rank's host key to tell a lost node; and, to leave
together, wrote its own key and checked the W-1 others' every 0.2 s. Its store client waited for a
key at most max(10 s, 2 intervals) and for an answer for ever (here bounded by a long deadline so
the benchmark ends). What is measured is the same as for the current code: exit code, seconds from
the fault, store requests and bytes from the roll call's start to the exit.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

ROLL_CALL_INTERVALS, DEPART_INTERVALS = 2.5, 3
LONG_DEADLINE_S = 300.0  # the old client had none: a request to a store that never answers waited for ever


class LegacyRank:
    """One simulated rank running the old protocol (a `store_sim._Member`, passed in as `member`)."""

    def __new__(cls, s: Any, port: int, rank: int, results: Any, *, member: type, client: Callable) -> Any:
        from bigclip.train.bounded_store import BoundedStore
        from bigclip.train.heartbeats import RollCall, describe_error
        from bigclip.train.watchdog import beat_interval, store_deadline

        interval = beat_interval(s.step_timeout_s)
        store = BoundedStore(
            partial(client, port, "old", store_deadline(interval)), deadline_s=LONG_DEADLINE_S
        )

        class _Legacy(member):
            def __init__(self) -> None:
                super().__init__(s, rank, results, store)
                self.interval, self.count, self.stop = interval, 0, threading.Event()
                self.host = f"node{rank // s.ranks_per_node}"
                self.beat()
                store.set(f"host/{rank}", self.host)

            def beat(self) -> None:
                self.count += 1
                value = json.dumps({"count": self.count, "step": 0, "where": "simulated", "host": self.host})
                with contextlib.suppress(Exception):
                    store.set(str(rank), value)

            def watch(self) -> None:
                threading.Thread(target=self._loop, daemon=True).start()

            def _loop(self) -> None:
                while not self.stop.wait(self.interval):
                    self.beat()

            def fail(self) -> None:
                self.stop.set()
                self.requests_at, self.bytes_at = store.requests, store.bytes_read
                store.set("failed", json.dumps({"rank": rank, "step": 0, "error": "collective"}))
                call = RollCall(s.world)
                try:
                    before = self.read()
                    deadline = time.monotonic() + ROLL_CALL_INTERVALS * interval
                    while time.monotonic() < deadline:
                        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
                        self.beat()
                    after = self.read()
                    call.silent = [r for r in range(s.world) if r != rank and
                                   (r not in after or (r in before and after[r] == before[r]))]  # fmt: skip
                    call.lost_nodes = self.lost_nodes(call.silent)
                except Exception as e:
                    call.store_error = describe_error(e)
                self.call = call
                self.depart([r for r in range(s.world) if r not in call.silent])
                self.exited(85 if call.lost_nodes else 1)

            def read(self) -> dict[int, int]:
                keys = [str(r) for r in range(s.world)]
                if not store.check(keys):
                    keys = [k for k in keys if store.check([k])]
                values = store.multi_get(keys) if keys else []
                return {int(k): json.loads(bytes(v).decode())["count"] for k, v in zip(keys, values)}

            def lost_nodes(self, silent: list[int]) -> list[str]:
                if not silent:
                    return []
                try:
                    hosts = [
                        bytes(h).decode() for h in store.multi_get([f"host/{r}" for r in range(s.world)])
                    ]
                except Exception:
                    return []
                quiet = set(silent)
                lost = {h for h in hosts if all(r in quiet for r, other in enumerate(hosts) if other == h)}
                return sorted(lost) if all(hosts[r] in lost for r in silent) else []

            def depart(self, answering: list[int]) -> None:
                try:
                    store.set(f"left/{rank}", "1")
                    others = [f"left/{r}" for r in answering if r != rank]
                    deadline = time.monotonic() + DEPART_INTERVALS * interval
                    next_beat = time.monotonic() + interval
                    while others and not store.check(others) and time.monotonic() < deadline:
                        time.sleep(0.2)
                        if time.monotonic() >= next_beat:
                            self.beat()
                            next_beat += interval
                except Exception:
                    pass

        return _Legacy()
