"""Background copy of a run's log directory to S3, as OpenCLIP's `--remote-sync`.

    sync = RemoteSync(run_dir, "s3://bucket/runs/NAME", every_s=300, protocol="s3").start()
    ...                                   # training; TensorBoard events and logs appear remotely
    sync.stop(final_sync=True)            # waits for a last, complete copy

Every `every_s` seconds a daemon thread uploads the files whose size or modification time
changed since their last successful upload. A failed upload is logged and simply stays
"changed", so the next round retries it; nothing here raises into training. Protocols:
"s3" goes through s3torchconnector (endpoint and path-style addressing from S3Settings);
"fsspec" uses whatever fsspec backend the URI names (s3fs for s3://, not installed by
default; file:// works everywhere). Checkpoints are excluded by default: they are written
straight to their own location (--checkpoint-dir), and copying half-written shards would
only waste bandwidth.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bigclip.errors import ConfigError, StorageError
from bigclip.storage.locations import open_location
from bigclip.storage.redact import redact_text
from bigclip.storage.s3 import S3Settings, is_s3

log = logging.getLogger("bigclip.train.remote_sync")

PROTOCOLS = ("s3", "fsspec")
_CHUNK = 8 << 20


class Target(Protocol):
    uri: str

    def upload(self, local: Path, relative: str) -> None: ...


class S3Target:
    # Few attempts per request: a failed file is retried next round anyway, and a long back-off
    # here would only delay the rest of the round (and the final sync).
    MAX_ATTEMPTS = 3

    def __init__(self, uri: str, *, s3: S3Settings | None) -> None:
        self._location = open_location(uri, s3=s3 or S3Settings.resolve(), max_attempts=self.MAX_ATTEMPTS)
        self.uri = self._location.uri

    def upload(self, local: Path, relative: str) -> None:
        with open(local, "rb") as source, self._location.open_write(relative) as out:
            while chunk := source.read(_CHUNK):
                out.write(chunk)


class FsspecTarget:
    def __init__(self, uri: str) -> None:
        import fsspec

        try:
            self._fs, self._root = fsspec.core.url_to_fs(uri)
        except (ImportError, ValueError) as e:
            raise StorageError(
                f"--remote-sync-protocol fsspec cannot handle {uri!r}: {e}. Install the fsspec backend "
                "for that scheme (s3fs for s3://), or use --remote-sync-protocol s3"
            ) from e
        self.uri = uri

    def upload(self, local: Path, relative: str) -> None:
        remote = f"{self._root.rstrip('/')}/{relative}"
        self._fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        self._fs.put_file(str(local), remote)


def make_target(uri: str, *, protocol: str, s3: S3Settings | None = None) -> Target:
    if protocol not in PROTOCOLS:
        raise ConfigError(f"--remote-sync-protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if protocol == "s3":
        if not is_s3(uri):
            raise ConfigError(f"--remote-sync-protocol s3 needs an s3:// URI, got {uri!r} (or use fsspec)")
        return S3Target(uri, s3=s3)
    return FsspecTarget(uri)


@dataclass
class SyncReport:
    uploaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


class RemoteSync:
    def __init__(
        self,
        local_dir: str | Path,
        remote_uri: str,
        *,
        every_s: float = 300.0,
        protocol: str = "s3",
        s3: S3Settings | None = None,
        exclude: tuple[str, ...] = ("checkpoints",),
    ) -> None:
        """Validates the protocol and target now, so a bad flag fails before training starts."""
        self.local_dir = Path(local_dir)
        self.target = make_target(remote_uri, protocol=protocol, s3=s3)
        self.every_s = every_s
        self.exclude = exclude
        self.upload_counts: dict[str, int] = {}
        self._synced: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) uploaded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RemoteSync:
        self._thread = threading.Thread(target=self._loop, name="bigclip-remote-sync", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, final_sync: bool = True, attempts: int = 3, backoff_s: float = 2.0) -> bool:
        """Stop the thread; then, if asked, sync until complete (up to `attempts` rounds).
        Returns whether everything reached the remote."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not final_sync:
            return True
        for attempt in range(attempts):
            if self.sync_once().ok:
                return True
            if attempt + 1 < attempts:
                time.sleep(backoff_s * (attempt + 1))
        log.error("remote sync: final sync to %s incomplete after %d attempts", self._safe_uri, attempts)
        return False

    def sync_once(self) -> SyncReport:
        """Upload every changed file once; failures are logged and left for the next round."""
        with self._lock:
            started = time.perf_counter()
            report = SyncReport()
            for path, relative, stamp in self._changed_files():
                try:
                    self.target.upload(path, relative)
                except Exception as e:  # never fatal: the file stays "changed" and is retried
                    report.failed[relative] = redact_text(f"{type(e).__name__}: {e}")
                    continue
                self._synced[relative] = stamp
                self.upload_counts[relative] = self.upload_counts.get(relative, 0) + 1
                report.uploaded.append(relative)
            report.seconds = time.perf_counter() - started
        self._log(report)
        return report

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sync_once()
            except Exception as e:  # e.g. the log directory vanished; keep the thread alive
                log.error("remote sync: round failed, will retry: %s", redact_text(str(e)))

    def _changed_files(self) -> Iterator[tuple[Path, str, tuple[int, int]]]:
        if not self.local_dir.is_dir():
            return
        for path in sorted(self.local_dir.rglob("*")):
            relative = path.relative_to(self.local_dir).as_posix()
            if not path.is_file() or self._excluded(relative):
                continue
            stat = path.stat()
            stamp = (stat.st_size, stat.st_mtime_ns)  # taken before the upload: a later write re-syncs
            if self._synced.get(relative) != stamp:
                yield path, relative, stamp

    def _excluded(self, relative: str) -> bool:
        parts = relative.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(fnmatch.fnmatch(p, pattern) for p in prefixes for pattern in self.exclude)

    @property
    def _safe_uri(self) -> str:
        return redact_text(self.target.uri)

    def _log(self, report: SyncReport) -> None:
        if report.uploaded:
            log.info(
                "remote sync: %d file(s) to %s in %.1fs", len(report.uploaded), self._safe_uri, report.seconds
            )
        for relative, error in report.failed.items():
            log.warning("remote sync: %s not copied (retried next round): %s", relative, error)
