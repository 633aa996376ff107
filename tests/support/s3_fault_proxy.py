"""A small fault-injecting HTTP proxy between an S3 client and the loopback S3 server.

Clients point their endpoint at the proxy (path-style addressing, so the bucket is in the
path); every request is forwarded to the real server unless a rule matches it first:

    "slowdown"  answer 503 SlowDown, as S3 does when throttling
    "drop"      read the request, then reset the connection without answering
    "stall"     hold the request until `release()`, then reset the connection
and `cut()` takes the endpoint away (every connection reset, none accepted).

    with FaultProxy(upstream=s3.endpoint) as proxy:
        proxy.add_rule("slowdown", method="PUT", path_contains=".distcp", times=3)
        ...                                        # proxy.injected counts what fired

S3 throttles per partitioned prefix: beyond about 3,500 writes and 5,500 reads a second on one
prefix it answers 503 SlowDown. `throttle(rate=...)` models that with a token bucket per prefix
(the key up to its last "/", i.e. the folder an object is in, or `prefix_of` to choose): a request
past its prefix's rate is answered 503 SlowDown, counted in `throttled`. `counts` tallies every
request by method and prefix (`refused`: those the throttle answered), and `tally()` sums them,
so a test can assert how many requests a save or an epoch start made and how they spread.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te"}
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>"
)
ACTIONS = ("slowdown", "drop", "stall")


@dataclass
class Rule:
    action: str
    method: str = ""
    path_contains: str = ""
    times: int = 1  # how many requests it fires on; -1: every matching request

    def matches(self, method: str, path: str) -> bool:
        return (not self.method or method == self.method) and self.path_contains in path


def folder_of(path: str) -> str:
    """The prefix S3 throttling is modelled on: bucket and key up to the key's last "/"."""
    key = urllib.parse.urlparse(path).path
    return key.rsplit("/", 1)[0] if "/" in key.strip("/") else key


@dataclass
class TokenBucket:
    """`rate` requests a second, bursts of up to `burst` (S3's per-prefix limit, scaled)."""

    rate: float
    burst: float
    tokens: float = 0.0
    stamp: float = 0.0

    def take(self, now: float) -> bool:
        if not self.stamp:
            self.tokens, self.stamp = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class FaultProxy:
    def __init__(self, *, upstream: str) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
        self.rules: list[Rule] = []
        self.injected: dict[str, int] = dict.fromkeys(ACTIONS, 0)
        self.requests: list[tuple[str, str]] = []
        self.counts: Counter[tuple[str, str]] = Counter()  # (method, prefix) -> requests
        self.throttled: Counter[str] = Counter()  # prefix -> requests answered 503 by the throttle
        self.refused: Counter[tuple[str, str]] = Counter()  # (method, prefix) -> of those
        self._buckets: dict[str, TokenBucket] = {}
        self._rate: float | None = None
        self._burst = 1.0
        self.prefix_of: Callable[[str], str] = folder_of
        self.stalled = threading.Event()  # set once a request is being held
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()  # open client connections (for `cut`)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_rule(self, action: str, *, method: str = "", path_contains: str = "", times: int = 1) -> None:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; one of {ACTIONS}")
        with self._lock:
            self.rules.append(Rule(action, method, path_contains, times))

    def throttle(
        self, *, rate: float | None, burst: float | None = None, prefix_of: Callable[[str], str] | None = None
    ) -> None:
        """Answer 503 SlowDown past `rate` requests a second per prefix (None: no throttle)."""
        with self._lock:
            self._rate, self._burst = rate, burst if burst is not None else max(1.0, rate or 1.0)
            self._buckets.clear()
            if prefix_of is not None:
                self.prefix_of = prefix_of

    def tally(self, *, method: str = "", prefix_contains: str = "", admitted: bool = False) -> int:
        """Requests seen (throttled ones included; with `admitted`, only those the throttle let
        through) of `method` on prefixes containing the text."""
        with self._lock:
            seen = Counter({k: n - (self.refused[k] if admitted else 0) for k, n in self.counts.items()})
            return sum(n for (m, p), n in seen.items()
                       if (not method or m == method) and prefix_contains in p)  # fmt: skip

    def clear_rules(self) -> None:
        with self._lock:
            self.rules.clear()

    def release(self) -> None:
        self._release.set()

    def take_action(self, method: str, path: str) -> str | None:
        """The action for this request (consuming one use of its rule), or None to forward it."""
        with self._lock:
            self.requests.append((method, path))
            prefix = self.prefix_of(path)
            self.counts[(method, prefix)] += 1
            if self._rate is not None:
                bucket = self._buckets.setdefault(prefix, TokenBucket(self._rate, self._burst))
                if not bucket.take(time.monotonic()):
                    self.throttled[prefix] += 1
                    self.refused[(method, prefix)] += 1
                    return "slowdown"
            for rule in self.rules:
                if rule.times != 0 and rule.matches(method, path):
                    rule.times -= 1 if rule.times > 0 else 0
                    self.injected[rule.action] += 1
                    return rule.action
        return None

    def start(self) -> FaultProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    def cut(self) -> None:
        """The endpoint goes away: stop listening and reset every open connection (keep-alive ones
        included, which `stop` leaves served), so every request from now on fails to connect."""
        self.stop()
        with self._lock:
            open_now, self._connections = list(self._connections), set()
        for connection in open_now:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)  # wakes its handler's read: close alone does not
            _reset(connection)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def setup(self) -> None:
            super().setup()
            with proxy._lock:
                proxy._connections.add(self.connection)

        def finish(self) -> None:
            with proxy._lock:
                proxy._connections.discard(self.connection)
            super().finish()

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return _read_chunked(self.rfile)
            return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

        def _handle(self) -> None:
            body = self._body()
            action = proxy.take_action(self.command, self.path)
            if action == "slowdown":
                self._reply(503, {"Content-Type": "application/xml"}, _SLOWDOWN_BODY)
            elif action == "drop":
                self._reset()
            elif action == "stall":
                proxy.stalled.set()
                proxy._release.wait(timeout=120)
                self._reset()
            else:
                self._forward(body)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        def _forward(self, body: bytes) -> None:
            upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=120)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                headers["Content-Length"] = str(len(body))
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                head = self.command == "HEAD"
                # A HEAD reply announces the object's size but carries no body: pass it through.
                skip = _HOP_BY_HOP if head else _HOP_BY_HOP | {"content-length"}
                kept = {k: v for k, v in response.getheaders() if k.lower() not in skip}
                self._reply(response.status, kept, data, head=head)
            finally:
                upstream.close()

        def _reply(self, status: int, headers: dict, body: bytes, *, head: bool = False) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if not head:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _reset(self) -> None:
            self.close_connection = True
            _reset(self.connection)

    return Handler


def _reset(connection: socket.socket) -> None:
    """SO_LINGER 0: close with a TCP reset, as a dropped connection looks to the client."""
    with contextlib.suppress(OSError):  # closed meanwhile
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.close()


def _read_chunked(stream) -> bytes:
    chunks = []
    while True:
        size = int(stream.readline().split(b";")[0].strip(), 16)
        if size == 0:
            stream.readline()
            return b"".join(chunks)
        chunks.append(stream.read(size))
        stream.readline()
