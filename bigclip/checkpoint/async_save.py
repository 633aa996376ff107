"""A checkpoint being uploaded in the background, the time training spent on it, and the staging
copy (DCP's stager) it uploads from."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from bigclip.errors import StorageError


@dataclass
class AsyncSave:
    """Returned by `CheckpointStore.async_save` once the state is staged in CPU memory.

    `blocked_s` is how long the caller was blocked (waiting for the previous save, plus
    staging); `waited_s` is the part spent waiting for the previous save. The store waits
    for this save before the next save or load, and on close.
    """

    uri: str
    step: int
    blocked_s: float
    waited_s: float
    future: Future

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed; returns the checkpoint URI, or raises StorageError."""
        try:
            return self.future.result(timeout=timeout)
        except (StorageError, TimeoutError):
            raise
        except BaseException as e:  # anything else from the upload thread
            raise StorageError(f"background save of {self.uri} failed: {type(e).__name__}: {e}") from e

    @property
    def error(self) -> BaseException | None:
        """The failure, once done (None while running or after success)."""
        return self.future.exception() if self.future.done() else None


class Staging:
    """DCP's stager, one per store: it reuses its CPU (pinned, on GPU) buffers from save to save."""

    def __init__(self) -> None:
        self._stager: DefaultStager | None = None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of `state` (copies may still be in flight on a GPU: `synchronize`)."""
        if self._stager is not None and _is_spent(self._stager):
            self.close()
        if self._stager is None:
            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
            self._stager = DefaultStager(options)
        return self._stager.stage(state)

    def synchronize(self) -> None:
        """Wait for the copies of the last `stage` (as dcp.async_save does after starting the upload)."""
        if self._stager is not None and self._stager.should_synchronize_after_execute:
            self._stager.synchronize_staging()

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _is_spent(stager: DefaultStager) -> bool:
    """torch 2.11's DefaultStager closes its copier at the end of every stage (it clears the copy
    dispatch table and the storage cache), so staging with it again fails with "KeyError: <class
    'type'>": there a stager serves one save (it kept no buffers anyway); 2.13's is reusable."""
    copier = getattr(stager, "_state_dict_stager", None)
    return copier is not None and not getattr(copier, "_deepcopy_dispatch", True)
