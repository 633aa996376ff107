"""A run folder in use is locked: two runs started with the same --logs and --name cannot both
write it (the second would overwrite the first's committed checkpoints).

    lock = RunLock(run_dir)
    group.on_rank0(lock.hold_if_exists)   # before the checks: a folder in use is refused now
    group.on_rank0(lock.take)             # once they passed: make the folder, lock, name the owner
    lock.release()                        # at the run's end (the kernel does it if the process dies)

The lock is a POSIX record lock (fcntl.lockf) on LOGS/NAME/.bigclip-run.lock, a file that names
its owner (host, pid, start time), so the refused run's line says which run is in the way. The
kernel drops the lock when its process ends, however it ends (an exception, SIGKILL, the OOM
killer; on NFS the lock lease of a lost node expires), so a requeued job, or `--resume latest`
after the first run exited, takes it again with nothing to clean up. Record locks belong to the
process that took them: forked data workers never hold the folder after the run; the price is
that the run's process must never open and close the lock file itself (closing any descriptor of
a file drops the process's record locks on it: --remote-sync skips hidden files). Only rank 0
locks (it writes the folder); the others learn its answer. `hold_if_exists` writes nothing, so an
earlier run's folder a refused start looked at stays byte for byte as it was. A file system
without locks (some FUSE or Lustre mounts) gets a warning and an unlocked run.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path

from bigclip.errors import ConfigError
from bigclip.train.metrics import get_logger

LOCK_NAME = ".bigclip-run.lock"  # hidden: --remote-sync skips it
_HELD = (errno.EACCES, errno.EAGAIN)  # what lockf answers when another process holds the lock


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def hold_if_exists(self) -> None:
        """Lock an existing folder's lock file (a new folder has none: `take` makes it)."""
        if self.held or not self.path.is_file():
            return
        self._lock(os.open(self.path, os.O_RDWR | os.O_CLOEXEC))

    def take(self) -> None:
        """Make the folder and hold its lock (unless held already), then record this run as its owner."""
        if not self.held:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
        if self._fd is not None:
            started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            os.ftruncate(self._fd, 0)
            os.pwrite(
                self._fd, f"host {socket.gethostname()} pid {os.getpid()} started {started}\n".encode(), 0
            )

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the record lock
            self._fd = None

    def _lock(self, fd: int) -> None:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in _HELD:
                raise ConfigError(self._in_use()) from None
            get_logger().warning(f"{self.path.parent} cannot be locked ({e.strerror}): this file system takes "
                                 "no locks, so a second run with the same --name would not be stopped")  # fmt: skip
            return
        self._fd = fd

    def _in_use(self) -> str:
        try:
            owner = self.path.read_text().strip() or "owner not recorded yet"
        except OSError:
            owner = "owner unknown"
        return (
            f"run folder {self.path.parent} is in use by another run ({owner}): a second run with the same "
            "--logs and --name would overwrite its checkpoints. Give another --name, or wait until that run "
            "ends (then --resume latest continues it)"
        )
