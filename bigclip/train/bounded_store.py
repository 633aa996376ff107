"""A store client whose every call returns or raises within a deadline, for the step watchdog.

torch's TCPStore client bounds only the wait for a key: a request whose answer does not come
(the store's process stopped, its node frozen or cut off) blocks forever, whatever the client's
timeout (measured on torch 2.11 and 2.13: `add`, `check`, `get`, `multi_get` and `wait` to a
SIGSTOPped server never return; `set` and `append`, which get no answer, return at once). A
watchdog that must report exactly then cannot make such calls on its own thread. So each call
runs on a worker thread of its own connection and the caller waits at most `deadline_s`: past
it, the call raises StoreUnresponsive and the connection is abandoned (its worker, a daemon
thread, stays blocked until the store answers or the process ends); the next call connects
afresh. A store that refuses or resets the connection (its process is gone) raises its own error
at once and is reconnected too; one whose host cannot be reached (no route: a cut link) raises
StoreUnresponsive at once. `requests` counts the calls made and `bytes_read` the values
received: the tests and the scale benchmark count what a roll call costs each rank.
"""

from __future__ import annotations

import datetime
import errno
import queue
import threading
from collections.abc import Callable
from typing import Any


class StoreUnresponsive(Exception):
    """The store did not answer within the deadline (its host stopped, frozen or cut off)."""


class _Connection:
    """One client and the daemon thread that makes its calls, in order."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect, self._client = connect, None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="bigclip-side-store", daemon=True).start()

    def submit(self, op: str, args: tuple) -> tuple[threading.Event, list]:
        done, box = threading.Event(), []
        self._calls.put((op, args, done, box))
        return done, box

    def close(self) -> None:
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            op, args, done, box = item
            try:
                if self._client is None:
                    self._client = self._connect()
                box.append((True, getattr(self._client, op)(*args)))
            except Exception as e:
                box.append((False, e))
            done.set()


class BoundedStore:
    """The store calls the heartbeats make (set, get, add, append, check, multi_get, wait), each
    bounded by `deadline_s` (a wait by its own timeout plus `deadline_s`)."""

    def __init__(self, connect: Callable[[], Any], *, deadline_s: float) -> None:
        self._connect, self.deadline_s = connect, deadline_s
        self._connection: _Connection | None = None
        self._lock = threading.Lock()  # the watchdog thread and a failing main thread may both call
        self.requests = 0
        self.bytes_read = 0

    def call(self, op: str, *args: Any, extra_s: float = 0.0) -> Any:
        with self._lock:
            if self._connection is None:
                self._connection = _Connection(self._connect)
            connection = self._connection
            self.requests += 1
            done, box = connection.submit(op, args)
            if not done.wait(self.deadline_s + extra_s):
                self._drop(connection)
                raise StoreUnresponsive(f"no answer to {op} within {self.deadline_s + extra_s:.0f} s")
            ok, value = box[0]
            if not ok:
                self._drop(connection)  # a reset or refused connection: connect afresh next time
                if _unreachable(value):  # no route to the store's host: as good as no answer
                    raise StoreUnresponsive(f"{op}: {value}") from value
                raise value
            self.bytes_read += _size(value)
            return value

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        if self._connection is connection:
            self._connection = None

    def set(self, key: str, value: str) -> None:
        self.call("set", key, value)

    def get(self, key: str) -> bytes:
        return self.call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self.call("add", key, amount)

    def append(self, key: str, value: str) -> None:
        self.call("append", key, value)

    def check(self, keys: list[str]) -> bool:
        return self.call("check", keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.call("multi_get", keys)

    def wait(self, keys: list[str], timeout_s: float) -> None:
        self.call("wait", keys, datetime.timedelta(seconds=timeout_s), extra_s=timeout_s)


def _unreachable(error: BaseException) -> bool:
    """The store's host cannot be reached (its link down, its route gone): not a refusal."""
    codes = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.ETIMEDOUT)
    return isinstance(error, TimeoutError) or (isinstance(error, OSError) and error.errno in codes)


def _size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, list):
        return sum(len(v) for v in value if isinstance(v, (bytes, bytearray)))
    return 0
