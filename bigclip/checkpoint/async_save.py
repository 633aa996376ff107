"""A checkpoint being uploaded in the background, and the time training spent on it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

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
        except StorageError:
            raise
        except TimeoutError:
            raise
        except BaseException as e:  # anything else from the upload thread
            raise StorageError(f"background save of {self.uri} failed: {type(e).__name__}: {e}") from e

    @property
    def error(self) -> BaseException | None:
        """The failure, once done (None while running or after success)."""
        return self.future.exception() if self.future.done() else None
