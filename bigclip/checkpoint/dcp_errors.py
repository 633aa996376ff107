"""DCP's failures as one-line StorageErrors that say what happened to the checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.checkpoint.api import CheckpointException

from bigclip.checkpoint.safe_load import unwrap_checkpoint_exception
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
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"rank {rank}: {explain_error(inner)}"
    return explain_error(exc)
