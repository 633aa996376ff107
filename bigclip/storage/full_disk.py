"""A write that found the disk full (ENOSPC, or EDQUOT: the quota), told in one line.

Local writers (local_location.py), DCP's checkpoint streams (hashing.py) and the error reader
(access_checks.explain_error) share it: the OSError is often wrapped (torch's zip writer raises its own
error while handling it), so the chain of errors is searched.
"""

from __future__ import annotations

import errno

from bigclip.errors import StorageError

_FULL = {errno.ENOSPC: "ENOSPC: no space left on device", errno.EDQUOT: "EDQUOT: disk quota exceeded"}


def disk_full(error: BaseException) -> str | None:
    """'ENOSPC: ...' when `error`, or an error it was raised from or while handling, is a full disk."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL:
            return _FULL[error.errno]
        error = error.__cause__ or error.__context__
    return None


FULL_WORDS = "the disk is full ("  # in every full-disk line, also once a line has crossed ranks as text


def says_disk_full(error: BaseException) -> bool:
    """`error` is, or reports, a full disk: no rerun gets past it until space is freed."""
    return disk_full(error) is not None or FULL_WORDS in str(error)


def full_error(
    error: BaseException, where: object, *, committed: str = "nothing was written under that name"
) -> StorageError | None:
    """The one-line error for a write to `where` that found the disk full, or None for other errors."""
    full = disk_full(error)
    if full is None:
        return None
    return StorageError(f"{where}: {FULL_WORDS}{full}); {committed}: free space there, or write elsewhere")
