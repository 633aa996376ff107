"""The run's remote copy (--remote-sync) and the checks a run makes against its own history.

With --remote-sync URI, rank 0 keeps REMOTE = URI/NAME in step with the run folder: logs,
TensorBoard, and every committed checkpoint under REMOTE/checkpoints (when checkpoints are
written locally; a --checkpoint-dir in an object store is remote already). Set-up, all before
the model is built and collective (rank 0 decides, every rank raises the same error):

  open_remote_sync  builds the RemoteSync and checks the target (credentials, list, put, get,
                    delete), so a wrong bucket fails in seconds, not after training;
  guard_new_run     a run without --resume whose checkpoint root or remote copy already holds
                    committed checkpoints is refused, as OpenCLIP refuses an existing
                    experiment, unless --overwrite-run (which deletes them first);
  resume_target     for --resume latest: the newest committed checkpoint of the local root and
                    the remote copy (ties go to the local one, faster to read), logged; a remote
                    one is read straight from the remote store by DCP, with no download step.
"""

from __future__ import annotations

from pathlib import Path

from bigclip.checkpoint import LATEST, CheckpointStore, catalog
from bigclip.config import TrainConfig
from bigclip.errors import ConfigError
from bigclip.storage.locations import LocalLocation, Location
from bigclip.train.metrics import get_logger
from bigclip.train.remote_sync import RemoteSync


def prepare_backup(cfg: TrainConfig, run_dir: Path, store: CheckpointStore) -> tuple[RemoteSync | None, str]:
    """Collective, before the model is built: the checked RemoteSync (rank 0; not started), the
    name-reuse guard, and what --resume loads ('' for nothing)."""
    sync = open_remote_sync(cfg, run_dir, store)
    guard_new_run(cfg, store, sync)
    return sync, resume_target(cfg, store, sync)


def remote_run_uri(cfg: TrainConfig) -> str:
    return f"{cfg.log.remote_sync.rstrip('/')}/{cfg.log.name}"


def open_remote_sync(cfg: TrainConfig, run_dir: Path, store: CheckpointStore) -> RemoteSync | None:
    """Collective. The checked RemoteSync on rank 0 (not started), None elsewhere or without the flag."""
    if not cfg.log.remote_sync:
        return None

    def build() -> RemoteSync:
        local = store.location if isinstance(store.location, LocalLocation) else None
        sync = RemoteSync(run_dir, remote_run_uri(cfg), every_s=cfg.log.remote_sync_frequency,
                          protocol=cfg.log.remote_sync_protocol, checkpoints=local,
                          remote_keep_last=cfg.checkpoint.remote_keep_last,
                          exclude=_inside(run_dir, local))  # fmt: skip
        sync.check()
        return sync

    made: list[RemoteSync] = []
    store.group.on_rank0(lambda: made.append(build()))  # errors reach every rank
    return made[0] if made else None


def _inside(run_dir: Path, local: LocalLocation | None) -> tuple[str, ...]:
    """The checkpoint root's path inside the run folder, if it is there (the mirror copies it)."""
    if local is None:
        return ()
    try:
        return (Path(local.root).relative_to(Path(run_dir).absolute()).as_posix(),)
    except ValueError:
        return ()


def _remote_checkpoints(sync: RemoteSync | None) -> Location | None:
    return sync.mirror.remote if sync is not None and sync.mirror is not None else None


def guard_new_run(cfg: TrainConfig, store: CheckpointStore, sync: RemoteSync | None) -> None:
    """Collective: refuse to start over an earlier run's checkpoints (see the module docstring). An
    evaluation-only run writes no checkpoint: it may evaluate in a run's folder."""
    if cfg.checkpoint.resume or cfg.evaluates_only:
        return

    def check() -> None:
        locations = [loc for loc in (store.location, _remote_checkpoints(sync)) if loc is not None]
        found = [(loc, newest) for loc in locations if (newest := catalog.latest_committed(loc))]
        if not found:
            return
        if not cfg.checkpoint.overwrite_run:
            loc, newest = found[0]
            raise ConfigError(
                f"experiment {cfg.log.name!r} exists: {loc.uri} holds committed checkpoints (the newest at "
                f"step {newest.step}). Use --resume latest to continue it or a new --name to start another "
                "run; --overwrite-run deletes them and starts over"
            )
        for loc, _ in found:
            for entry in catalog.entries(loc):
                catalog.delete_checkpoint(loc, entry)
            get_logger().warning(f"--overwrite-run: deleted the checkpoints under {loc.uri}")

    store.group.on_rank0(check)


def resume_target(cfg: TrainConfig, store: CheckpointStore, sync: RemoteSync | None) -> str:
    """Collective: what `store.load` should read for --resume ('' for nothing yet)."""
    which = cfg.checkpoint.resume
    if which != LATEST:
        return which

    def choose() -> str:
        local = catalog.latest_committed(store.location)
        remote_location = _remote_checkpoints(sync)
        remote = catalog.latest_committed(remote_location) if remote_location else None
        log = get_logger()
        if remote is not None and (local is None or remote.step > local.step):
            uri = remote_location.child_uri(remote.folder)
            newer = f"the local newest is step {local.step}" if local else f"{store.root} holds none"
            log.info(f"--resume latest: remote copy {uri} (step {remote.step}; {newer}), read directly")
            return uri
        if local is None:
            where = f"{store.root} or {remote_location.uri}" if remote_location else store.root
            log.info(f"--resume latest: no committed checkpoint in {where} yet, starting from step 0")
            return ""
        remote_note = f"; the remote copy's newest is step {remote.step}" if remote else ""
        log.info(
            f"--resume latest: local {store.location.child_uri(local.folder)} (step {local.step}{remote_note})"
        )
        return store.location.child_uri(local.folder)

    return store.group.on_rank0(choose)
