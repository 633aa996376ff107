"""Leases: a run declares that it uses a published checkpoint, so `rm` cannot pull it away.

A lease is one small object, `leases/NAME/<id>.json`, holding its owner (run name), host, pid,
creation time and expiry. The run's rank 0 renews it from a daemon thread (every `ttl / 10`)
and deletes it when the run ends; a process that dies (SIGKILL, node loss) stops renewing, so
its lease expires after `ttl`. A lease is stale when it expired, or when its host is this
host and its pid is gone; `checkpoints rm --break-stale-leases` removes stale leases, never
live ones.

Acquire and rm race safely because each writes its marker before checking the other's:
acquire writes the lease, then checks the checkpoint is published and not being deleted;
rm writes `deleting`, then lists leases. With S3's read-after-write consistency at least one
of the two sees the other.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass

from bigclip.errors import StorageError
from bigclip.storage.local_location import pid_alive
from bigclip.storage.locations import Location

log = logging.getLogger("bigclip.registry")

LEASES = "leases"
DEFAULT_TTL_S = 600.0


@dataclass(frozen=True)
class Lease:
    id: str
    name: str  # the published checkpoint
    owner: str  # who holds it: a run name or a user's label
    host: str
    pid: int
    created: float  # seconds since the epoch
    expires: float

    def stale(self) -> bool:
        if self.expires < time.time():
            return True
        return self.host == socket.gethostname() and not pid_alive(self.pid)

    def describe(self) -> str:
        state = "stale" if self.stale() else "live"
        left = self.expires - time.time()
        return (
            f"{self.id} ({state}) owner {self.owner!r} on {self.host} pid {self.pid}, "
            f"{'expired' if left < 0 else 'expires in'} {abs(left):.0f}s{' ago' if left < 0 else ''}"
        )


def lease_path(name: str, lease_id: str) -> str:
    return f"{LEASES}/{name}/{lease_id}.json"


def list_leases(root: Location, name: str) -> list[Lease]:
    found = []
    for file in sorted(root.list_files(f"{LEASES}/{name}")):
        if not file.endswith(".json"):
            continue
        try:
            found.append(Lease(**json.loads(root.read_bytes(f"{LEASES}/{name}/{file}"))))
        except (ValueError, TypeError, FileNotFoundError) as e:
            log.warning("ignoring unreadable lease %s/%s: %s", name, file, e)
    return found


class HeldLease:
    """A lease this process holds: renewed in the background until `release`."""

    def __init__(self, root: Location, name: str, *, owner: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.root, self.ttl_s = root, ttl_s
        now = time.time()
        self.lease = Lease(
            id=f"{int(now)}-{secrets.token_hex(6)}",
            name=name,
            owner=owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            created=now,
            expires=now + ttl_s,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> str:
        return lease_path(self.lease.name, self.lease.id)

    def write(self) -> None:
        body = {**asdict(self.lease), "expires": time.time() + self.ttl_s}
        self.root.write_bytes(self.path, (json.dumps(body, indent=1) + "\n").encode())

    def start_renewing(self) -> HeldLease:
        self._thread = threading.Thread(target=self._renew_loop, name="bigclip-lease", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 10):
            try:
                self.write()
            except Exception as e:  # keep trying: the lease stays valid until it expires
                log.warning("renewing lease %s failed: %s", self.path, e)

    def release(self) -> None:
        """Idempotent; a failed delete leaves a lease that expires after its ttl."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self.root.delete(self.path)
            log.info("released lease on %s", self.lease.name)
        except Exception as e:
            log.warning("could not delete lease %s (it expires in %.0fs): %s", self.path, self.ttl_s, e)


def break_stale(root: Location, name: str) -> tuple[list[Lease], list[Lease]]:
    """Delete the stale leases on `name`; returns (broken, still live)."""
    broken, live = [], []
    for lease in list_leases(root, name):
        if lease.stale():
            root.delete(lease_path(lease.name, lease.id))
            broken.append(lease)
        else:
            live.append(lease)
    return broken, live


def refuse_if_leased(leases: list[Lease], name: str) -> None:
    if not leases:
        return
    lines = "\n  ".join(lease.describe() for lease in leases)
    stale = any(lease.stale() for lease in leases)
    hint = (
        "; stale leases (from runs that died) can be removed with --break-stale-leases"
        if stale
        else "; wait for the runs to end"
    )
    raise StorageError(f"{name} is in use ({len(leases)} lease(s)){hint}:\n  {lines}")
