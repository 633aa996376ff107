"""CheckpointStore: sharded DCP checkpoints in any location (a folder, S3...), committed atomically.

    store = CheckpointStore(root)              # collective; root: a path or URI (storage/locations.py)
    store.check_access()                       # collective; seconds; before any model is built
    uri = store.save(state, step=s, meta=m)    # collective; returns once committed
    pending = store.async_save(state, step=s)  # collective; returns after staging to CPU
    manifest = store.load(state, "latest")     # collective; in place, any world size

Commit protocol: every rank streams its shards through DCP (checksums computed on the way),
DCP's coordinator writes `.metadata` once all ranks' writes returned, then rank 0 writes
`manifest.json` with every rank's object list. No manifest, no checkpoint: `latest()` and
`load()` never see an interrupted save. A state holding NaN or inf is refused before a byte
is written; loading checks every byte against the CRC-32s and SHA-256 its writer recorded, as
it streams (verified_reader.py), and "latest" skips a damaged checkpoint for an older one. Coordination uses a gloo group of its own, created
here (coordination.py), because async saves run collectives from a background thread and
must never interleave with the training group's (NCCL) traffic. The store saves whatever dict DCP can
save, so every engine (FSDP2, DeepSpeed) uses it.
"""

from __future__ import annotations

import logging
import socket
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed.checkpoint as dcp

from bigclip.checkpoint import catalog, lookup, rank_record
from bigclip.checkpoint.async_save import AsyncSave, Staging
from bigclip.checkpoint.coordination import CheckpointGroup
from bigclip.checkpoint.dcp_errors import dcp_errors
from bigclip.checkpoint.finite import NonFiniteState, first_non_finite, plain_state
from bigclip.checkpoint.integrity import CheckpointDamaged
from bigclip.checkpoint.manifest import RANK_RECORDS, Manifest
from bigclip.checkpoint.rank_local_load import load_sharded
from bigclip.checkpoint.rank_local_save import write_rank
from bigclip.checkpoint.safe_load import SafeLoadPlanner
from bigclip.checkpoint.save_commit import (
    PieceCache,
    commit,
    outcome,
)
from bigclip.checkpoint.verified_reader import VerifiedReader
from bigclip.distributed import launch_env
from bigclip.errors import StorageError
from bigclip.storage.access_checks import check_access, explain_error
from bigclip.storage.hashing import HashingFileSystem
from bigclip.storage.locations import Location, open_location, open_parent

log = logging.getLogger("bigclip.checkpoint")

LATEST = lookup.LATEST

# Single-process use (no process group) is intended here; DCP would warn on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointStore:
    def __init__(
        self,
        root: str,
        *,
        keep_last: int = 0,
        io_threads: int | None = None,
        max_attempts: int | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        """Collective when torch.distributed is initialised (it creates a gloo group).

        keep_last: retention applied after each commit (0 keeps all; see `keep_last_for`).
        io_threads: files (and upload streams) per rank per save (None: the location's choice:
            4 on a local disk, on S3 one per GiB of the rank's shard, at most 4).
        max_attempts: tries per request on an object store (S3's CRT client's default is 10).
        timeout_s: how long checkpoint collectives may wait for a slow rank.
        """
        if not root:
            raise StorageError("no checkpoint location given: pass a path or s3://bucket/prefix")
        self.location: Location = open_location(root, max_attempts=max_attempts)
        self.keep_last = keep_last
        self.io_threads = io_threads
        self.group = CheckpointGroup(timeout_s=timeout_s)
        # Rank 0 only, set by the caller: told of each commit (the remote mirror wakes on it), and
        # asked before retention deletes a committed checkpoint (the mirror may still need it).
        self.on_commit: Callable[[str, Manifest], None] | None = None
        self.keep: Callable[[catalog.Entry], bool] | None = None
        self._pending: AsyncSave | None = None
        self._staging = Staging()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bigclip-checkpoint")
        self._pieces = PieceCache()  # rank 0: every rank's last .metadata piece

    @property
    def root(self) -> str:
        return self.location.uri

    def check_access(self) -> None:
        """Preflight, collective: StorageError on every rank, in seconds, if the root is unusable.

        One rank per node (local rank 0, whichever launcher set it) probes: credentials usually
        differ by node (instance roles), and 1024 ranks probing at once could be throttled.
        """
        error = None
        if launch_env()[2] == 0:
            try:
                check_access(self.location)
            except StorageError as e:
                error = f"{socket.gethostname()} (rank {self.group.rank}): {e}"
        errors = [e for e in self.group.gather(error) if e]
        more = f" (and {len(errors) - 2} more nodes)" if len(errors) > 2 else ""
        message = self.group.broadcast("; ".join(errors[:2]) + more if errors else None)
        if message:
            raise StorageError(message)

    # -- saving ---------------------------------------------------------------------------

    def save(
        self, state: dict[str, Any], *, step: int, meta: dict[str, Any] | None = None, rank_state: Any = None
    ) -> str:
        """Write `state` as checkpoint `step` and commit it; every rank returns its URI.

        `rank_state`: this rank's own JSON-able training state (RNG, data position), kept in its
        record and read back by `rank_state` (the same rank, or whoever merges them)."""
        self.wait()
        state = self._refuse_non_finite(state, step)
        return self._write(state, self._begin(step), meta or {}, rank_state)

    def async_save(
        self, state: dict[str, Any], *, step: int, meta: dict[str, Any] | None = None, rank_state: Any = None
    ) -> AsyncSave:
        """Stage `state` in CPU memory, then write and commit it in the background."""
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        state = self._refuse_non_finite(state, step)
        begun = self._begin(step)
        with dcp_errors(f"staging {self.location.child_uri(begun[0])}"):
            staged = self._staging.stage(state)
        finish = self._executor.submit(self._write, staged, begun, dict(meta or {}), rank_state)
        self._staging.synchronize()
        blocked = time.perf_counter() - started
        self._pending = AsyncSave(
            uri=self.location.child_uri(begun[0]),
            step=step,
            blocked_s=blocked,
            waited_s=waited,
            future=finish,
        )
        log.info("checkpoint step %d staged in %.3fs; uploading in the background", step, blocked - waited)
        return self._pending

    def wait(self) -> str | None:
        """Wait for the async save in flight, if any; its URI, or StorageError if it failed."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def _refuse_non_finite(self, state: dict[str, Any], step: int) -> dict[str, Any]:
        """Collective: `state` with its Statefuls' state dicts, or StorageError on every rank, before
        anything is written, when a tensor holds NaN or inf: damage is never committed."""
        plain = plain_state(state)
        found = [(rank, key) for rank, key in enumerate(self.group.gather(first_non_finite(plain))) if key]
        problem = self.group.broadcast(found[0] if found else None)
        if problem is not None:
            latest = self.group.on_rank0(self.latest)
            raise NonFiniteState(
                f"checkpoint step {step} refused: {problem[1]} holds NaN or inf (rank {problem[0]}); nothing "
                f"was written, the latest checkpoint is still {latest or 'none'}: resume from it with "
                "--resume latest (a lower --lr or --grad-clip-norm may keep the run finite)"
            )
        return plain

    def _begin(self, step: int) -> tuple[str, int, HashingFileSystem, Any]:
        folder = catalog.step_folder(step)
        # Rank 0 empties the folder before any rank can write to it; also a sync point.
        self.group.on_rank0(lambda: catalog.clear_folder(self.location, folder))
        writer, hashing = self.location.dcp_writer(
            folder, threads=self.io_threads, world_size=self.group.world_size
        )
        return folder, step, hashing, writer

    def _write(self, state: dict[str, Any], begun: tuple, meta: dict[str, Any], rank_state: Any) -> str:
        """Collective: every rank writes its part (rank_local_save.py), then the commit."""
        folder, step, hashing, writer = begun
        written, error = None, None
        try:
            written = write_rank(state, writer, rank=self.group.rank, train=rank_state)
        except Exception as e:  # every rank must reach the commit's collectives to learn of it
            error = explain_error(e)
        error, manifest = commit(
            self.group,
            location=self.location,
            folder=folder,
            writer=writer,
            hashing=hashing,
            written=written,
            mine=outcome(written, error, hashing),
            cache=self._pieces,
            manifest={"step": step, "world_size": self.group.world_size, "meta": meta},
        )
        uri = self.location.child_uri(folder)
        if error:
            raise StorageError(
                f"saving {uri} failed: {error}; the checkpoint was not committed (the previous commit, if "
                "any, is still the latest)"
            )
        log.info("checkpoint step %d committed: %s", step, uri)
        if manifest is not None:
            self._after_commit(folder, manifest)
        return uri

    def _after_commit(self, folder: str, manifest: Manifest) -> None:
        if self.on_commit is not None:
            try:
                self.on_commit(folder, manifest)
            except Exception as e:  # a listener must never fail the save that committed
                log.warning("after committing %s: %s", folder, e)
        if self.keep_last > 0:
            self._retain()

    def _retain(self) -> None:
        try:
            catalog.apply_retention(self.location, keep_last=self.keep_last, keep=self.keep)
        except Exception as e:  # a failed deletion must not fail the save that triggered it
            log.warning("checkpoint retention failed (will retry after the next save): %s", e)

    # -- loading --------------------------------------------------------------------------

    def latest(self) -> str | None:
        """URI of the newest committed checkpoint under the root, or None."""
        entry = catalog.latest_committed(self.location)
        return self.location.child_uri(entry.folder) if entry else None

    def committed(self) -> list[tuple[int, str]]:
        """(step, URI) of every committed checkpoint, newest first."""
        return [
            (e.step, self.location.child_uri(e.folder)) for e in catalog.entries(self.location) if e.committed
        ]

    def load(
        self,
        state: dict[str, Any],
        which: str = LATEST,
        *,
        fall_back: bool | None = None,
        optional_keys: tuple[str, ...] = (),
    ) -> Manifest:
        """Load a committed checkpoint into `state` in place (resharding as needed); collective.

        `which`: see lookup.py; `optional_keys`: see SafeLoadPlanner. Every byte read is checked against what its writer recorded and
        every floating tensor for NaN/inf, as it streams (verified_reader.py): damage raises
        `CheckpointDamaged`. `fall_back` (default: `which` is "latest"): a damaged checkpoint is
        skipped, in one warning line, for the next older commit of its root; an explicit
        checkpoint never falls back.
        """
        self.wait()
        fall_back = which == LATEST if fall_back is None else fall_back
        root_uri, folders = self.group.on_rank0(
            lambda: lookup.candidates(self.location, which, fall_back=fall_back)
        )
        location = open_location(root_uri, any_scheme=True)
        for index, folder in enumerate(folders):
            try:
                return self._load_folder(state, location, folder, optional_keys)
            except CheckpointDamaged as e:
                if index + 1 == len(folders):
                    raise
                log.warning("skipped damaged checkpoint %s (%s); loading the next older one, %s",
                            location.child_uri(folder), e, location.child_uri(folders[index + 1]))  # fmt: skip
        raise AssertionError("unreachable: candidates() returns at least one folder")

    def manifest_meta(self, which: str) -> tuple[str, dict[str, Any], int] | None:
        """(URI, caller's meta, step) of the checkpoint `which` names, from its manifest alone (not
        collective); None when its manifest cannot be read (loading it names the damage)."""
        location, folder = lookup.resolve(self.location, which)
        found = lookup.inspect(location, folder)
        return None if isinstance(found, str) else (found.uri, found.meta, found.step)

    def _load_folder(
        self, state: dict[str, Any], location: Location, folder: str, optional_keys: tuple[str, ...]
    ) -> Manifest:
        found = self.group.on_rank0(lambda: lookup.summary(lookup.inspect(location, folder)))
        if isinstance(found, str):
            raise CheckpointDamaged(found)
        inner = location.dcp_reader(folder)
        if found.layout == RANK_RECORDS:
            with dcp_errors(f"loading {found.uri}", saving=False, reader=inner):
                load_sharded(
                    state, location, folder, inner,
                    saved_world=found.world_size, group=self.group, optional_keys=optional_keys,
                    record_of=lambda k: rank_record.record_of(found.prefixes, k, found.world_size),
                )  # fmt: skip
        else:  # saved before rank records: every rank reads the global .metadata
            reader = VerifiedReader(inner, uri=found.uri, objects=found.objects)
            with dcp_errors(f"loading {found.uri}", saving=False, reader=inner):
                reader.read_metadata()  # damage raised here, not inside DCP (which logs a traceback)
                dcp.load(
                    state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self.group.group
                )
        log.info("loaded checkpoint step %d (saved at world size %d) from %s, every byte verified",
                 found.step, found.world_size, found.uri)  # fmt: skip
        return found

    def rank_state(self, manifest: Manifest, rank: int) -> Any:
        """Saved rank `rank`'s own training state (`save(rank_state=...)`), checked against its
        writer's SHA-256; None for a checkpoint saved before rank records or `rank` beyond its world."""
        if manifest.layout != RANK_RECORDS or rank >= manifest.world_size:
            return None
        location, folder = open_parent(manifest.uri, any_scheme=True)
        return rank_record.read_train(
            location, folder, rank_record.record_of(manifest.prefixes, rank, manifest.world_size)
        )

    def verify(self, which: str = LATEST) -> Manifest:
        """Re-read every object of a checkpoint and check sizes and SHA-256 (not collective)."""
        location, folder = lookup.resolve(self.location, which)
        manifest = lookup.inspect(location, folder)
        if isinstance(manifest, str):
            raise CheckpointDamaged(manifest)
        problems = manifest.objects.checksum_problems(lambda name: location.open_read(f"{folder}/{name}"))
        if problems:
            raise StorageError(f"checkpoint {manifest.uri} failed verification:\n  " + "\n  ".join(problems))
        return manifest

    # -- housekeeping ---------------------------------------------------------------------

    def apply_retention(self, *, keep_last: int) -> list[str]:
        """Keep the newest `keep_last` committed checkpoints (0: all); rank 0 deletes, others no-op."""
        if self.group.rank != 0:
            return []
        return catalog.apply_retention(self.location, keep_last=keep_last, keep=self.keep)

    def close(self) -> None:
        """Wait for the save in flight and release the staging buffers and the worker thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._staging.close()
