"""The Checkpointer: when the run saves, what it keeps, and the save in flight.

    checkpointer = Checkpointer(store, contents, cfg=cfg.checkpoint, sync=sync, ...)
    signum = checkpointer.maybe_save(state, data_position=loader.rank_state)   # every step
    checkpointer.save_at_epoch_end(state)
    checkpointer.save_at_end(state, data_position=loader.rank_state)
    checkpointer.close(strict=True)                                            # then the final sync

When: one decision (save_schedule.py: every N steps, epochs or minutes of training, a stop
request, the end), taken once per step with one tiny all-reduce that also carries the stop
request, so the ranks always agree. A step is never saved twice, nor over the checkpoint the run
resumed from (`saved_step`). The data position is asked for only when a save happens.

What is kept (rank 0, after each commit): --keep-last / --delete-previous-checkpoint locally
(--remote-keep-last for an s3:// root), held back until the --remote-sync copy has each
checkpoint; the copy is woken at once and prunes its side to --remote-keep-last.
--save-most-recent is OpenCLIP's epoch_latest.pt on bigclip's checkpoints: a checkpoint at every
epoch end whatever --save-frequency says; one saved only for that reason is marked in its
manifest and deleted when a newer checkpoint commits (locally; the remote copy follows), so
besides the --save-frequency ones only the most recent survives. Unlike OpenCLIP's, it works
with --remote-sync and --resume latest: commits are atomic, so nothing half-written is copied.

--async-save: the store stages the state in CPU memory and uploads in the background; `wait`
blocks until it is committed (before forking data workers, before the run reports success).

A failed save (save_schedule.OnFailure): a periodic one is one warning line on rank 0 and training
goes on (the step is not marked saved, so the end can still save it); an async one is reported
as soon as its upload fails, and the next save, `wait` or `close` goes on past it. A failed stop
request's or final save raises `SaveFailed`: the loop leaves the requeue marker and exits with
the requeue code, unless the disk is full (a rerun would fill it again: the error ends the run). A state holding NaN or inf (`NonFiniteState`) ends the run whatever the cadence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Protocol

from bigclip.checkpoint import CheckpointStore, Manifest, catalog, keep_last_for
from bigclip.checkpoint.async_save import AsyncSave
from bigclip.checkpoint.finite import NonFiniteState
from bigclip.checkpoint.mirror import MOST_RECENT_ONLY
from bigclip.config import CheckpointConfig, TrainConfig
from bigclip.errors import StorageError
from bigclip.storage.access_checks import explained
from bigclip.storage.full_disk import says_disk_full
from bigclip.train.checkpoint_contents import TrainState
from bigclip.train.metrics import Scalars, get_logger
from bigclip.train.preflight import check_shared_folder
from bigclip.train.remote_sync import RemoteSync
from bigclip.train.save_schedule import Boundary, Due, OnFailure, TrainingClock, agree, save_due
from bigclip.train.signals import SignalFlag

ASKED = Due("asked", on_failure=OnFailure.RAISE)  # a save the caller asked for, outside the cadence


class SaveFailed(Exception):
    """A stop request's or the end's checkpoint failed: the run ends with the requeue code, and the
    requeued job resumes from the latest committed checkpoint. Not a BigclipError: it is no bad
    input, and must not end the run with code 2."""

    def __init__(self, step: int, reason: str, error: BaseException) -> None:
        super().__init__(f"checkpoint step {step} ({reason}) failed: {explained(error)}")
        self.step = step


class Contents(Protocol):
    """What a checkpoint holds (checkpoint_contents.CheckpointContents for a training run)."""

    def state(self, train_state: TrainState) -> dict[str, Any]: ...

    def rank_state(self, data_position: dict | None) -> dict[str, Any]: ...

    def meta(self, *, most_recent_only: bool = False) -> dict[str, Any]: ...


def open_store(cfg: TrainConfig, run_dir: Path) -> CheckpointStore:
    """Collective; the access check fails in seconds (wrong bucket, no credentials) before any model."""
    store = CheckpointStore(cfg.checkpoint.checkpoint_dir or str(run_dir / "checkpoints"))
    store.check_access()
    check_shared_folder(store)  # a local folder: every node's must be the same one
    return store


class Checkpointer:
    def __init__(
        self,
        store: CheckpointStore,
        contents: Contents,
        *,
        cfg: CheckpointConfig,
        preemption: SignalFlag,
        scalars: Scalars,
        sync: RemoteSync | None = None,
        saved_step: int = -1,
        pause: Callable[[], AbstractContextManager[Any]] = nullcontext,
        verify: Callable[[int], None] = lambda step: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Rank 0 wires retention into the store and starts `sync` (rank 0's; None elsewhere).
        `saved_step`: the step of the checkpoint just loaded (never saved over). `pause`: held while saving (the step watchdog's). `verify(step)`:
        collective, raises before a save if the weights may be damaged. `clock`: seconds, for the
        minutes cadence (read on rank 0 only)."""
        self.store, self.contents, self.cfg, self.sync = store, contents, cfg, sync
        self.preemption, self.scalars = preemption, scalars
        self.saved_step = saved_step
        self.committed_step = saved_step  # the newest step known committed (-1: none yet)
        self._in_flight: tuple[int, Due] | None = None  # the async save being uploaded
        self.training = TrainingClock(clock)
        self._pause, self._verify = pause, verify
        self._is_rank0 = store.group.rank == 0
        self._keep()
        if sync is not None:
            sync.start()

    # -- when -----------------------------------------------------------------------------

    def maybe_save(self, state: TrainState, *, data_position: Callable[[], dict | None]) -> int:
        """Collective, once after every optimizer step inside an epoch: save if due. Returns the
        stop signal the ranks agreed on (0: none); the loop stops after this save."""
        every_s = self.cfg.save_every_n_minutes * 60
        rank0_due = self._is_rank0 and every_s > 0 and self.training.seconds() >= every_s
        signum, minutes_due = agree(stop_signal=self.preemption.signum, rank0_due=rank0_due)
        if signum:
            self.preemption.announce(signum)
        due = save_due(self.cfg, state, Boundary.STEP, minutes_due=minutes_due, stop_signal=signum)
        self._save_if(due, state, data_position)
        return signum

    def save_at_epoch_end(self, state: TrainState) -> None:
        """Collective, after the epoch's accounting and evaluation (the next epoch starts fresh)."""
        self._save_if(save_due(self.cfg, state, Boundary.EPOCH_END), state, lambda: None)

    def save_at_end(self, state: TrainState, *, data_position: Callable[[], dict | None]) -> None:
        """Collective, after the last step."""
        position = data_position if state.epoch_step else lambda: None  # None: the next epoch's start
        self._save_if(save_due(self.cfg, state, Boundary.END), state, position)

    def _save_if(self, due: Due | None, state: TrainState, data_position: Callable[[], dict | None]) -> None:
        if due is None:
            return
        self.wait()  # a failed upload of this very step must not make it look saved
        if state.step != self.saved_step:
            self.save(state, data_position=data_position(), due=due)

    def paused(self) -> AbstractContextManager[None]:
        """Time that is not training (evaluation, building a loader): the minutes cadence skips it."""
        return self.training.paused()

    # -- saving ---------------------------------------------------------------------------

    def save(self, state: TrainState, *, data_position: dict | None, due: Due = ASKED) -> None:
        """Collective. Logs (and sends to the metric sinks) how long training was blocked. A
        failure is handled as `due.on_failure` says (module docstring)."""
        started = time.perf_counter()
        self.wait()  # the upload in flight first: the store would wait for it anyway
        waited = time.perf_counter() - started
        if state.step == self.saved_step:
            return  # this step is saved (or was just loaded): never replace a committed checkpoint
        with self._pause():
            self._verify(state.step)  # never save weights a non-finite step updated
            started = time.perf_counter()
            try:
                where, mode = self._write(state, data_position, due=due)
            except NonFiniteState:
                raise  # the run diverged: no later save would be any better
            except StorageError as e:
                self.training.restart()  # the next save is a whole cadence away, not the next step
                self._failed(state.step, due, e)
                return
        blocked = waited + time.perf_counter() - started
        self.saved_step = state.step
        self.training.restart()
        get_logger().info(
            f"checkpoint step {state.step} -> {where} ({mode}; {due.reason}); training blocked {blocked:.3f}s"
        )
        self.scalars.scalars({"checkpoint/blocked_s": blocked}, step=state.step)

    def _write(self, state: TrainState, data_position: dict | None, *, due: Due) -> tuple[str, str]:
        contents, mine = self.contents.state(state), self.contents.rank_state(data_position)
        meta = self.contents.meta(most_recent_only=not due.kept)
        if self.cfg.async_save:
            pending = self.store.async_save(contents, step=state.step, meta=meta, rank_state=mine)
            self._in_flight = (state.step, due)
            pending.future.add_done_callback(lambda _: self._uploaded(pending, due))
            return pending.uri, "async, uploading"
        where = self.store.save(contents, step=state.step, meta=meta, rank_state=mine)
        self.committed_step = state.step
        return where, "committed"

    def _uploaded(self, pending: AsyncSave, due: Due) -> None:
        """In the upload's thread, as it ends: a periodic save's failure is said at once."""
        if pending.error is not None and due.on_failure is OnFailure.CONTINUE:
            self._warn(pending.step, due, pending.error)

    def wait(self) -> None:
        """Block until the async save in flight, if any, is committed; its failure is handled as its
        `due` says (a failed periodic save was said already; a failed stop-request or final one
        raises SaveFailed)."""
        in_flight, self._in_flight = self._in_flight, None
        try:
            self.store.wait()
        except StorageError as e:
            if in_flight is None:
                raise  # not a save of ours
            step, due = in_flight
            if self.saved_step == step:
                self.saved_step = self.committed_step  # not saved after all: the end may save it
            if due.on_failure is not OnFailure.CONTINUE:
                self._failed(step, due, e)  # raises
        else:
            if in_flight is not None:
                self.committed_step = in_flight[0]

    def _failed(self, step: int, due: Due, error: StorageError) -> None:
        if due.on_failure is OnFailure.RAISE or (
            due.on_failure is OnFailure.REQUEUE and says_disk_full(error)
        ):
            raise error  # a full disk: a rerun would fill it again
        if due.on_failure is OnFailure.REQUEUE:
            raise SaveFailed(step, due.reason, error) from error
        self._warn(step, due, error)

    def _warn(self, step: int, due: Due, error: BaseException) -> None:
        if self._is_rank0:  # every rank learns of the failure; one line says it
            latest = (
                f"the latest checkpoint stays step {self.committed_step}"
                if self.committed_step >= 0
                else "with no checkpoint committed yet,"
            )
            get_logger().warning(
                f"checkpoint step {step} ({due.reason}) failed; training goes on, {latest} and the next save "
                f"tries again: {error}"
            )

    def latest(self) -> str | None:
        return self.store.latest()

    def close(self, *, strict: bool = True) -> None:
        """Wait for the save in flight, then the final remote sync (`strict`: raise if incomplete)."""
        try:
            self.wait()
        finally:
            self.store.close()
        if self.sync is not None:
            self.sync.finish(strict=strict)

    # -- what is kept ---------------------------------------------------------------------

    def _keep(self) -> None:
        """Rank 0: retention after each commit, the --save-most-recent pruning, and waking the sync."""
        store, sync = self.store, self.sync
        store.keep_last = keep_last_for(self.cfg, store.root)
        if not self._is_rank0:
            return
        pruner = MostRecentPruner(store) if self.cfg.save_most_recent else None
        if sync is not None and sync.mirror is not None:
            store.keep = sync.mirror.needed  # local retention waits for the copy: the sync prunes after each
            if store.keep_last > 0:
                sync.on_backed_up = lambda: store.apply_retention(keep_last=store.keep_last)

        def on_commit(folder: str, manifest: Manifest) -> None:
            if pruner is not None:
                pruner.committed(folder, manifest)
            if sync is not None:
                sync.notify()

        store.on_commit = on_commit


class MostRecentPruner:
    """Deletes a --save-most-recent-only checkpoint when a newer one is committed (rank 0)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.location = store.location
        flagged = [e for e in catalog.entries(self.location) if e.committed and self._flagged(e.folder)]
        self.flagged = [e.folder for e in flagged]  # left by an earlier attempt: pruned on the next commit

    def _flagged(self, folder: str) -> bool:
        return bool(catalog.read_manifest(self.location, folder).meta.get(MOST_RECENT_ONLY))

    def committed(self, folder: str, manifest: Manifest) -> None:
        for old in self.flagged:
            if old != folder:
                catalog.delete_checkpoint(self.location, catalog.Entry(int(old.split("_")[1]), old, True))
        self.flagged = [folder] if manifest.meta.get(MOST_RECENT_ONLY) else []
