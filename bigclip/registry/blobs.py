"""The registry's content-addressed store: every file's bytes once, under `blobs/<sha[:2]>/<sha256>`,
shared by every published name that holds them.

Storing: a file whose SHA-256 is known beforehand (a bigclip checkpoint's manifest lists it; a
local file is hashed first) is not sent at all when its blob exists. Other streams (HTTP, remote
objects without a manifest) go to `staging/<random>` while being hashed, then are renamed (a
server-side copy on S3) to their blob, or dropped if it already exists. Every write is whole or
absent (sinks.py), and a blob never changes: its name is its content.

Concurrency and crashes (say what is safe):
  - Two publishes of the same bytes at once write the same blob with the same bytes: whichever
    lands last, the blob is right; names are created with create-if-absent, so at most one
    publish of a NAME succeeds.
  - A publish killed midway leaves blobs no manifest refers to (and perhaps a staging object);
    publishing again reuses the blobs; the next sweep deletes what is still unreferenced.
  - Sweeping (after `rm`, or `bigclip checkpoints gc`) deletes blobs no published manifest
    refers to. A publish in flight may rely on a blob it found already stored and not yet
    listed in any manifest, so the two exclude each other through two markers, each written
    before the other's is checked: a publish holds an intent (`leases/_publishing/<id>.json`,
    renewed, expiring like a lease) and then waits while `gc.lock` exists; a sweep creates
    `gc.lock` (create-if-absent) and then lists intents, skipping the sweep if any live one
    exists. With read-after-write consistency (S3, local disks) either the sweep sees the
    intent, or the publish sees the lock and waits until the sweep is over before it looks
    at any blob. A dead publisher's intent goes stale (expired, or dead pid on this host) and
    a dead sweeper's lock expires, so neither blocks the other for long.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from bigclip.errors import StorageError
from bigclip.registry.leases import HeldLease, break_stale, pid_alive
from bigclip.storage.locations import LocalLocation, Location, open_location
from bigclip.storage.records import ObjectRecord

log = logging.getLogger("bigclip.registry")

BLOBS, STAGING, GC_LOCK = "blobs", "staging", "gc.lock"
PUBLISHING = "_publishing"  # the lease "name" publish intents are held under (never a valid NAME)
GC_LOCK_TTL_S = 900.0
_CHUNK = 16 << 20


def blob_path(sha256: str) -> str:
    return f"{BLOBS}/{sha256[:2]}/{sha256}"


def sha256_of_file(path: Path) -> ObjectRecord:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return ObjectRecord(size=size, sha256=digest.hexdigest())


class BlobStore:
    def __init__(self, location: Location) -> None:
        self.location = location
        self.uploaded_bytes = 0  # bytes this process sent (the registry tests and `publish` report it)

    def has(self, sha256: str) -> bool:
        return self.location.exists(blob_path(sha256))

    def sizes(self, hashes: Iterable[str]) -> dict[str, int]:
        """Stored size of each blob that exists (one listing per two-character shard)."""
        shards: dict[str, set[str]] = defaultdict(set)
        for sha in hashes:
            shards[sha[:2]].add(sha)
        found = {}
        for shard, wanted in shards.items():
            listing = self.location.list_files(f"{BLOBS}/{shard}")
            found.update({sha: listing[sha] for sha in wanted if sha in listing})
        return found

    def remove_stale_temporaries(self) -> list[str]:
        """Temporary files a killed publish left under blobs/ and staging/ (local registries; an
        S3 upload cut short leaves no object), removed; their names."""
        if not isinstance(self.location, LocalLocation):
            return []
        shards = sorted(p.name for p in (self.location.root / BLOBS).glob("*") if p.is_dir())
        folders = [f"{BLOBS}/{shard}" for shard in shards] + [STAGING]
        return [name for folder in folders for name in self.location.remove_stale_temporaries(folder)]

    # -- storing ---------------------------------------------------------------------------

    def put_local(self, path: Path, expected: ObjectRecord | None = None) -> ObjectRecord:
        """A local file: hashed first, sent only if its blob is missing."""
        record = expected or sha256_of_file(path)
        if not self.has(record.sha256):
            with open(path, "rb") as stream:
                self._write(blob_path(record.sha256), stream, expected=record)
        return record

    def put_stream(self, stream: BinaryIO, expected: ObjectRecord | None = None) -> ObjectRecord:
        """A stream: skipped if its known hash is stored; else staged while hashed, then promoted."""
        if expected is not None:
            if not self.has(expected.sha256):
                self._write(blob_path(expected.sha256), stream, expected=expected)
            return expected
        staging = f"{STAGING}/{secrets.token_hex(12)}"
        record = self._write(staging, stream, expected=None)
        try:
            if not self.has(record.sha256):
                self._promote(staging, blob_path(record.sha256))
        finally:
            self.location.delete(staging)
        return record

    def _write(self, relative: str, stream: BinaryIO, *, expected: ObjectRecord | None) -> ObjectRecord:
        sink = self.location.open_sink(relative, overwrite=True)  # same name, same bytes: a race is harmless
        try:
            while chunk := stream.read(_CHUNK):
                sink.write(chunk)
            record = sink.record()
            if expected is not None and record != expected:
                raise StorageError(
                    f"the source object is damaged (size {record.size}, sha256 {record.sha256[:12]}..., its "
                    f"manifest says size {expected.size}, sha256 {expected.sha256[:12]}...)"
                )
        except BaseException:
            sink.abort()
            raise
        sink.commit()
        self.uploaded_bytes += record.size
        return record

    def _promote(self, staging: str, final: str) -> None:
        if isinstance(self.location, LocalLocation):
            target = Path(self.location.root) / final
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(Path(self.location.root) / staging, target)
        else:
            self.location.copy(staging, final)  # server-side on S3

    # -- sweeping --------------------------------------------------------------------------

    def sweep(self, referenced: set[str]) -> tuple[int, str]:
        """Delete blobs and staging objects no manifest refers to; (bytes freed, what happened)."""
        if not self._lock():
            return 0, "another sweep is running; unreferenced blobs stay until the next one"
        try:
            broken, live = break_stale(self.location, PUBLISHING)
            if live:
                return 0, (f"{len(live)} publish(es) in flight; unreferenced blobs stay until the next "
                           "`bigclip checkpoints rm` or `gc`")  # fmt: skip
            freed = self._delete_unreferenced(referenced)
            self.location.delete_folder(STAGING)
            return freed, "swept"
        finally:
            self.location.delete(GC_LOCK)

    def _delete_unreferenced(self, referenced: set[str]) -> int:
        blobs = open_location(self.location.child_uri(BLOBS))
        freed = 0
        for shard in blobs.list_folders():
            for sha, size in blobs.list_files(shard).items():
                if sha not in referenced:
                    blobs.delete(f"{shard}/{sha}")
                    freed += size
        return freed

    def _lock(self) -> bool:
        body = {"host": socket.gethostname(), "pid": os.getpid(), "expires": time.time() + GC_LOCK_TTL_S}
        if self.location.create_exclusive(GC_LOCK, json.dumps(body).encode()):
            return True
        if not self._lock_is_stale():
            return False
        self.location.delete(GC_LOCK)  # a dead sweeper's lock
        return self.location.create_exclusive(GC_LOCK, json.dumps(body).encode())

    def _lock_is_stale(self) -> bool:
        try:
            body = json.loads(self.location.read_bytes(GC_LOCK))
        except Exception:  # gone meanwhile, or unreadable: treat as stale
            return True
        mine = body.get("host") == socket.gethostname()
        return body["expires"] < time.time() or (mine and not pid_alive(int(body.get("pid", 0))))

    # -- publishing's side of the protocol ---------------------------------------------------

    def intend(self, *, owner: str) -> HeldLease:
        """Declare a publish in flight, then wait for a sweep in progress to end (see the docstring)."""
        intent = HeldLease(self.location, PUBLISHING, owner=owner, ttl_s=600.0)
        intent.write()
        deadline = time.monotonic() + GC_LOCK_TTL_S
        while self.location.exists(GC_LOCK) and not self._lock_is_stale():
            if time.monotonic() > deadline:
                intent.release()
                raise StorageError(f"{self.location.uri}/{GC_LOCK} is held by a sweep that does not end")
            time.sleep(0.5)
        return intent.start_renewing()
