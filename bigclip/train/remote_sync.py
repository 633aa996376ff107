"""Background backup of a run, as OpenCLIP's `--remote-sync`: its log folder and its checkpoints.

    sync = RemoteSync(run_dir, "s3://bucket/runs/NAME", every_s=300, checkpoints=LocalLocation(...))
    sync.check()            # before the model is built: credentials, list, put, get, delete
    sync.start()            # a daemon thread; notify() (called on each commit) wakes it at once
    report = sync.stop()    # the final round, waited for; report.ok / report.summary()

Remote layout, OpenCLIP's: REMOTE/out.log, config.yaml, tensorboard/..., and
REMOTE/checkpoints/step_N/ for every committed local checkpoint (`CheckpointMirror`: objects
first, manifest last, so a reader's `latest` is always whole; unchanged objects not re-sent).

Log files whose size or mtime changed are uploaded each round; a failure is logged and the
file stays "changed", so the next round retries it. A remote file an earlier attempt of the
run left (listed on the first round) is never overwritten by something else: the local file
replaces it only if it extends it (a requeue on the same disk appends to out.log), otherwise
it goes up as NAME.attempt-<UTC time>.EXT beside it (a new machine after a spot interruption).

The target is opened `fork_safe` (on S3: boto3, not s3torchconnector, whose CRT clients are torn
down at every fork, while the training process forks data workers as this thread may be
uploading: storage/s3_location.py). --remote-sync-protocol s3 takes the URI's own scheme and refuses
any other; "fsspec" reaches any fsspec scheme (gcsfs for gs://, s3fs for s3://, file:// everywhere).
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bigclip.checkpoint.mirror import CheckpointMirror, MirrorReport
from bigclip.errors import ConfigError, StorageError
from bigclip.storage.access_checks import check_access, explain_error
from bigclip.storage.locations import FSSPEC, LocalLocation, Location, open_location
from bigclip.storage.redact import redact_text

log = logging.getLogger("bigclip.train.remote_sync")

PROTOCOLS = ("s3", FSSPEC)
CHECKPOINTS = "checkpoints"
_IN_MEMORY = 64 << 20  # smaller files are read whole first: a log appended mid-upload stays consistent


def open_target(uri: str, *, protocol: str) -> Location:
    """Where --remote-sync writes, by protocol (validated before the model is built). Few tries
    per request: the sync retries on its own schedule."""
    if protocol not in PROTOCOLS:
        raise ConfigError(f"--remote-sync-protocol must be one of {PROTOCOLS}, got {protocol!r}")
    try:
        return open_location(uri, protocol=protocol, fork_safe=True, max_attempts=3)
    except ConfigError as e:
        raise ConfigError(f"--remote-sync-protocol {protocol} needs an {protocol}:// URI, got {uri!r} "
                          "(or use fsspec)") from e  # fmt: skip
    except StorageError as e:
        raise StorageError(f"--remote-sync-protocol {protocol} cannot handle {uri!r}: {e}") from e


@dataclass
class SyncReport:
    uploaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # what could not be copied -> why
    checkpoints: list[MirrorReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        """One line naming what is missing remotely and why (for the run's final error)."""
        what, why = next(iter(self.failed.items()))
        more = f" (and {len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
        return f"{what} was not backed up: {why}{more}"


def attempt_name(relative: str, attempt: str) -> str:
    """'logs/out.log' -> 'logs/out.attempt-20250101T000000.log'."""
    folder, _, name = relative.rpartition("/")
    stem, dot, suffix = name.rpartition(".")
    renamed = f"{stem}.attempt-{attempt}.{suffix}" if dot and stem else f"{name}.attempt-{attempt}"
    return f"{folder}/{renamed}" if folder else renamed


class RemoteSync:
    def __init__(
        self,
        local_dir: str | Path,
        remote_uri: str,
        *,
        every_s: float = 300.0,
        protocol: str = "s3",
        checkpoints: LocalLocation | None = None,
        remote_keep_last: int = 0,
        exclude: tuple[str, ...] = (),
    ) -> None:
        """Validates the protocol and target now, so a bad flag fails before training starts.
        `checkpoints`: the local checkpoint root to mirror to REMOTE/checkpoints (None: logs only)."""
        if every_s <= 0:
            raise ConfigError(f"--remote-sync-frequency must be a positive number of seconds, got {every_s}")
        self.local_dir, self.every_s = Path(local_dir), every_s
        self.target = open_target(remote_uri.rstrip("/"), protocol=protocol)
        self.mirror = None
        if checkpoints is not None:
            remote = open_target(f"{remote_uri.rstrip('/')}/{CHECKPOINTS}", protocol=protocol)
            self.mirror = CheckpointMirror(checkpoints, remote, keep_last=remote_keep_last)
        self.exclude = (*exclude, CHECKPOINTS)  # checkpoints go through the mirror, whole ones only
        # called after a round that copied a checkpoint (local pruning waits for it; the Checkpointer sets it)
        self.on_backed_up: Callable[[], object] | None = None
        self.attempt = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.upload_counts: dict[str, int] = {}
        self._synced: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) uploaded
        self._names: dict[str, str] = {}  # relative path -> where it goes remotely
        self._lock = threading.Lock()
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def uri(self) -> str:
        return redact_text(self.target.uri)

    def check(self) -> None:
        """Credentials, list, put, get and delete on the target, in seconds (StorageError)."""
        check_access(self.target, what="--remote-sync target")

    def start(self) -> RemoteSync:
        self._thread = threading.Thread(target=self._loop, name="bigclip-remote-sync", daemon=True)
        self._thread.start()
        return self

    def notify(self) -> None:
        """Sync now rather than at the next period (called when a checkpoint commits)."""
        self._wake.set()

    def stop(self, *, final_sync: bool = True, attempts: int = 3, backoff_s: float = 2.0) -> SyncReport:
        """Stop the thread; then, if asked, sync until complete (up to `attempts` rounds)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        report = SyncReport()
        for attempt in range(attempts if final_sync else 0):
            try:
                report = self.sync_once()
            except Exception as e:  # e.g. the run folder vanished: a failed round, not a crash
                report = SyncReport(failed={"the run folder": redact_text(explain_error(e))})
            if report.ok:
                break
            if attempt + 1 < attempts:
                time.sleep(backoff_s * (attempt + 1))
        if not report.ok:
            log.error(
                "remote sync to %s incomplete after %d attempts: %s", self.uri, attempts, report.summary()
            )
        return report

    def finish(self, *, strict: bool) -> None:
        """The final round, waited for; if it stays incomplete, `strict` raises one line saying
        what is not backed up and why (the run then exits non-zero)."""
        report = self.stop(final_sync=True)
        if not report.ok and strict:
            raise StorageError(f"remote sync to {self.uri} incomplete: {report.summary()}")

    def sync_once(self) -> SyncReport:
        """One round: changed log files, then committed checkpoints the remote lacks."""
        with self._lock:
            started = time.perf_counter()
            report = SyncReport()
            self._sync_logs(report)
            if self.mirror is not None:
                report.checkpoints = self.mirror.sync()
                report.failed.update({f"checkpoint {f}": why for f, why in self.mirror.failures.items()})
                if report.checkpoints and self.on_backed_up is not None:
                    self._backed_up()
            report.seconds = time.perf_counter() - started
        self._log(report)
        return report

    def _backed_up(self) -> None:
        try:
            self.on_backed_up()
        except Exception as e:  # local pruning is retried after the next copy
            log.warning("after a backup: %s", redact_text(explain_error(e)))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.every_s)
            self._wake.clear()
            if self._stop.is_set():
                return  # stop() runs the final round itself
            try:
                self.sync_once()
            except Exception as e:  # e.g. the log directory vanished; keep the thread alive
                log.error("remote sync: round failed, will retry: %s", redact_text(explain_error(e)))

    # -- log files --------------------------------------------------------------------------

    def _sync_logs(self, report: SyncReport) -> None:
        for path, relative, stamp in self._changed_files():
            try:
                self._upload(path, relative)
            except FileNotFoundError:
                continue  # a temporary file that is gone; nothing to keep
            except Exception as e:  # never fatal: the file stays "changed" and is retried
                report.failed[relative] = redact_text(explain_error(e))
                continue
            self._synced[relative] = stamp
            self.upload_counts[relative] = self.upload_counts.get(relative, 0) + 1
            report.uploaded.append(relative)

    def _upload(self, path: Path, relative: str) -> None:
        destination = self._destination(path, relative)
        if path.stat().st_size <= _IN_MEMORY:
            self.target.write_bytes(destination, path.read_bytes())
        else:
            self.target.put_file(destination, path)

    def _destination(self, path: Path, relative: str) -> str:
        """Where `relative` goes: its own name, unless that would overwrite an earlier attempt's file."""
        if relative not in self._names:
            name = relative
            if self.target.exists(relative) and not self._extends(path, relative):
                name = attempt_name(relative, self.attempt)
                log.info("remote %s is from an earlier attempt and is kept; this attempt's copy is %s",
                         relative, name)  # fmt: skip
            self._names[relative] = name
        return self._names[relative]

    def _extends(self, path: Path, relative: str) -> bool:
        """Whether the local file starts with the remote one's bytes (an append: nothing is lost)."""
        if path.stat().st_size > _IN_MEMORY:
            return False  # too big to compare cheaply: keep both
        remote = self.target.read_bytes(relative)
        with open(path, "rb") as f:
            return f.read(len(remote)) == remote

    def _changed_files(self) -> Iterator[tuple[Path, str, tuple[int, int]]]:
        if not self.local_dir.is_dir():
            return
        for path in sorted(self.local_dir.rglob("*")):
            relative = path.relative_to(self.local_dir).as_posix()
            if path.name.startswith(".") or not path.is_file() or self._excluded(relative):
                continue  # hidden files are temporaries (atomic writes in progress)
            stat = path.stat()
            stamp = (stat.st_size, stat.st_mtime_ns)  # taken before the upload: a later write re-syncs
            if self._synced.get(relative) != stamp:
                yield path, relative, stamp

    def _excluded(self, relative: str) -> bool:
        parts = relative.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(fnmatch.fnmatch(p, pattern) for p in prefixes for pattern in self.exclude)

    def _log(self, report: SyncReport) -> None:
        if report.uploaded:
            log.info("remote sync: %d file(s) to %s in %.1fs", len(report.uploaded), self.uri, report.seconds)
        for relative, error in report.failed.items():
            log.warning("remote sync: %s not copied (retried next round): %s", relative, error)
