"""DCP's failures as one-line StorageErrors that say what happened to the checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from bigclip.errors import StorageError
from bigclip.storage.access_checks import explain_error
from bigclip.storage.safe_metadata import metadata_failure_of


@contextmanager
def dcp_errors(action: str, *, saving: bool = True, reader: object = None) -> Iterator[None]:
    """Turn DCP's CheckpointException (a BaseException) and I/O errors into a StorageError.

    `reader`: the load's storage reader. DCP swallows why `.metadata` could not be read (see
    `SafeMetadataMixin`) and fails later with "metadata is None"; that cause is reported instead.
    """
    try:
        yield
    except StorageError:
        raise
    except (Exception, CheckpointException) as e:
        inner = metadata_failure_of(reader) or unwrap_checkpoint_exception(e)
        if isinstance(inner, StorageError):
            raise inner from e
        consequence = (
            "; the checkpoint was not committed (the previous commit, if any, is still the latest)"
            if saving
            else ""
        )
        raise StorageError(f"{action} failed: {first_line(inner)}{consequence}") from e


def summarize_failures(failed: list[str]) -> str:
    first = failed[0].split(": ", 2)
    return f"{len(failed)} object(s) failed to write, e.g. {first[0]} {first[1]}: {explain_error(first[2])}"


def first_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if failures:
        rank = min(failures)
        return f"rank {rank}: {explain_error(_failure_of(failures, rank))}"
    return explain_error(exc)


def unwrap_checkpoint_exception(exc: BaseException) -> BaseException:
    """DCP wraps per-rank failures in CheckpointException; surface our own error if one is inside."""
    failures = getattr(exc, "failures", None) or {}
    for rank in sorted(failures):
        inner = _failure_of(failures, rank)
        if isinstance(inner, StorageError):
            return inner
    return exc


def _failure_of(failures: dict[int, Any], rank: int) -> BaseException:
    """Rank `rank`'s exception in a CheckpointException's failures (kept alone or with its traceback)."""
    failure = failures[rank]
    return failure[0] if isinstance(failure, tuple) else failure
