"""Back up committed checkpoints to a second location without ever exposing a partial one.

    mirror = CheckpointMirror(LocalLocation("logs/run/checkpoints"), remote, keep_last=0)
    reports = mirror.sync()        # every local commit the remote lacks, newest first

For each checkpoint: its objects go up first, then one listing checks every object's size,
then its `manifest.json` (the same bytes as the local one) is written last. A remote reader's
`latest` therefore only ever sees whole checkpoints, whatever happens mid-copy (a SIGKILL
leaves a folder without a manifest, which every reader ignores and the next copy replaces).
What is already remote is not sent again: a checkpoint whose remote manifest equals the local
one is skipped, and an object whose SHA-256 (from the manifests) is already held by a remote
checkpoint is copied server-side instead of uploaded. Only the newest `keep_last` checkpoints
are candidates when the remote keeps that many, and remote retention runs after each commit.

Local retention asks `needed(entry)` before deleting a committed checkpoint, so a checkpoint
is not pruned locally before it reached the remote (see `CheckpointStore.keep`). A checkpoint
deleted locally mid-copy (a superseded --save-most-recent one) is skipped, never committed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bigclip.checkpoint import catalog
from bigclip.checkpoint.manifest import MANIFEST_NAME, Manifest
from bigclip.errors import StorageError
from bigclip.storage.locations import LocalLocation, Location

log = logging.getLogger("bigclip.checkpoint.mirror")

MOST_RECENT_ONLY = "most_recent_only"  # manifest meta: superseded by the next commit (--save-most-recent)
_INDEXED_REMOTE = 3  # remote commits whose objects are offered as copy sources at start


@dataclass
class MirrorReport:
    folder: str
    step: int
    total_bytes: int  # the checkpoint's size
    uploaded_bytes: int  # sent from this host
    copied_bytes: int  # copied server-side from an identical remote object
    seconds: float
    lag_s: float  # from the local commit (manifest mtime) to the remote commit


class CheckpointMirror:
    def __init__(self, local: LocalLocation, remote: Location, *, keep_last: int = 0) -> None:
        self.local, self.remote, self.keep_last = local, remote, keep_last
        self._lock = threading.Lock()
        self._mirrored: dict[str, int] = {}  # folder -> step, committed remotely with our bytes
        self._sources: dict[str, str] = {}  # sha256 -> a remote object holding those bytes
        self._flagged: set[str] = set()  # remote most-recent-only checkpoints
        self._scanned = False
        self.failures: dict[str, str] = {}  # folder -> why its last copy failed

    # -- what to copy ---------------------------------------------------------------------

    def needed(self, entry: catalog.Entry) -> bool:
        """Whether the local checkpoint must be kept for the mirror (not yet copied)."""
        with self._lock:
            if entry.folder in self._mirrored:
                return False
            newer = sum(1 for step in self._mirrored.values() if step > entry.step)
        return not (self.keep_last and newer >= self.keep_last)  # the remote would drop it at once

    def pending(self) -> list[catalog.Entry]:
        """Local commits the remote lacks (or holds with other bytes), newest first."""
        committed = [e for e in catalog.entries(self.local) if e.committed]
        if self.keep_last:
            committed = committed[: self.keep_last]
        if not self._scanned:
            self._scan(committed)
        with self._lock:
            return [e for e in committed if e.folder not in self._mirrored]

    def _scan(self, local: list[catalog.Entry]) -> None:
        """Once: which local commits the remote already holds, and its newest objects' hashes."""
        remote = [e for e in catalog.entries(self.remote) if e.committed]
        remote_folders = {e.folder for e in remote}
        for entry in local:
            if entry.folder not in remote_folders:
                continue
            if self._remote_manifest(entry.folder) == self._local_manifest(entry.folder):
                self._mirrored[entry.folder] = entry.step  # already there: not copied again
        for entry in remote[:_INDEXED_REMOTE]:
            raw = self._remote_manifest(entry.folder)
            if raw is not None:
                self._index(entry.folder, Manifest.from_json(raw, uri=self.remote.child_uri(entry.folder)))
        self._scanned = True

    def _index(self, folder: str, manifest: Manifest) -> None:
        for name, record in manifest.objects.items():
            self._sources.setdefault(record.sha256, f"{folder}/{name}")
        if manifest.meta.get(MOST_RECENT_ONLY):
            self._flagged.add(folder)

    def _remote_manifest(self, folder: str) -> bytes | None:
        try:
            return self.remote.read_bytes(f"{folder}/{MANIFEST_NAME}")
        except (*self.remote.read_errors, StorageError, FileNotFoundError):
            return None

    def _local_manifest(self, folder: str) -> bytes | None:
        try:
            return (Path(self.local.root) / folder / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            return None

    # -- copying --------------------------------------------------------------------------

    def sync(self) -> list[MirrorReport]:
        """Copy every pending checkpoint; a failed one is recorded in `failures` and retried
        by the next call. Returns what was committed remotely."""
        done, pending = [], self.pending()
        self.failures = {f: why for f, why in self.failures.items() if f in {e.folder for e in pending}}
        for entry in pending:
            try:
                report = self.copy(entry)
            except Exception as e:  # any store's errors (gcsfs, adlfs...): recorded, retried next round
                self.failures[entry.folder] = str(e)
                log.warning("backing up %s failed (retried next round): %s", entry.folder, e)
                continue
            self.failures.pop(entry.folder, None)
            if report is not None:
                done.append(report)
        return done

    def copy(self, entry: catalog.Entry) -> MirrorReport | None:
        """Objects, a size check, then the manifest. None if the checkpoint vanished locally."""
        started = time.perf_counter()
        raw = self._local_manifest(entry.folder)
        if raw is None:
            return None  # deleted locally (superseded) since it was listed
        manifest = Manifest.from_json(raw, uri=self.local.child_uri(entry.folder))
        if self.remote.exists(f"{entry.folder}/{MANIFEST_NAME}"):
            # Another checkpoint of this step is remote (a run resumed from an older one): uncommit
            # it first, so no reader ever pairs its manifest with the objects replaced below.
            log.warning("replacing the remote %s, which differs", self.remote.child_uri(entry.folder))
            self.remote.delete(f"{entry.folder}/{MANIFEST_NAME}")
        uploaded = copied = 0
        try:
            for name, record in manifest.objects.items():
                if self._copy_remote(record.sha256, f"{entry.folder}/{name}"):
                    copied += record.size
                else:
                    self.remote.put_file(
                        f"{entry.folder}/{name}", Path(self.local.root) / entry.folder / name
                    )
                    uploaded += record.size
        except FileNotFoundError:
            if self._local_manifest(entry.folder) is None:
                return self._abandon(entry)
            raise
        if self._local_manifest(entry.folder) is None:
            return self._abandon(entry)
        self._commit(entry, manifest, raw)
        report = MirrorReport(entry.folder, entry.step, manifest.total_bytes, uploaded, copied,
                              time.perf_counter() - started, self._lag(entry.folder))  # fmt: skip
        log.info("backed up %s to %s: %d of %d bytes uploaded, %d copied remotely, in %.2fs; "
                 "committed remotely %.2fs after its local commit", entry.folder, self.remote.uri, uploaded,
                 manifest.total_bytes, copied, report.seconds, report.lag_s)  # fmt: skip
        self._after_commit(entry, manifest)
        return report

    def _copy_remote(self, sha256: str, target: str) -> bool:
        """Copy an identical remote object server-side; False when there is none (or it failed)."""
        source = self._sources.get(sha256)
        if source is None or source == target:
            return False
        try:
            self.remote.copy(source, target)
            return True
        except Exception as e:  # the source was deleted meanwhile, say: upload instead
            log.info("server-side copy of %s failed (%s); uploading instead", source, e)
            self._sources.pop(sha256, None)
            return False

    def _abandon(self, entry: catalog.Entry) -> None:
        """The checkpoint was deleted locally mid-copy (superseded): drop its uncommitted copy."""
        log.info("%s was deleted locally while being backed up; its partial copy is removed", entry.folder)
        self.remote.delete_folder(entry.folder)

    def _commit(self, entry: catalog.Entry, manifest: Manifest, raw: bytes) -> None:
        problems = manifest.objects.size_problems(self.remote.list_files(entry.folder))
        if problems:
            raise StorageError(f"{self.remote.child_uri(entry.folder)} is incomplete: {'; '.join(problems)}")
        if self._local_manifest(entry.folder) != raw:
            raise StorageError(f"{self.local.child_uri(entry.folder)} changed while it was copied")
        self.remote.write_bytes(f"{entry.folder}/{MANIFEST_NAME}", raw)

    def _after_commit(self, entry: catalog.Entry, manifest: Manifest) -> None:
        with self._lock:
            self._mirrored[entry.folder] = entry.step
        superseded = {f for f in self._flagged if f < entry.folder}  # step folders sort by step
        self._index(entry.folder, manifest)
        for folder in sorted(superseded):
            self._delete(catalog.Entry(int(folder.split("_")[1]), folder, True))
        if self.keep_last:
            for uri in catalog.apply_retention(self.remote, keep_last=self.keep_last):
                self._forget(uri.rstrip("/").rsplit("/", 1)[-1])

    def _delete(self, entry: catalog.Entry) -> None:
        catalog.delete_checkpoint(self.remote, entry)
        self._forget(entry.folder)

    def _forget(self, folder: str) -> None:
        self._flagged.discard(folder)
        self._sources = {h: src for h, src in self._sources.items() if not src.startswith(f"{folder}/")}

    def _lag(self, folder: str) -> float:
        try:
            return time.time() - os.stat(Path(self.local.root) / folder / MANIFEST_NAME).st_mtime
        except FileNotFoundError:
            return float("nan")
