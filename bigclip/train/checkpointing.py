"""The training loop's checkpoint policy: when to save, what a checkpoint holds, how to resume.

Storage, commit and resharding live in `bigclip.checkpoint.CheckpointStore`; this module
decides the contents:
  model, optim   the engine's Stateful state (resharded by DCP to the current world size)
  train          step, epoch, steps into the epoch, samples seen, the data-loader position
                 (world-size independent), every rank's RNG state, the resolved config
Per-rank values are gathered into one replicated list, since DCP keeps one copy of a key that
several ranks hold. A run resumed at M ranks gives rank r the RNG of saved rank r when it
existed, else a fresh stream seeded from (seed, rank, step).

--save-most-recent is OpenCLIP's epoch_latest.pt on bigclip's checkpoints: a checkpoint at every
epoch end whatever --save-frequency says; one saved only for that reason is marked in its
manifest and deleted once a newer checkpoint commits (locally; the remote copy follows), so
besides the --save-frequency ones only the most recent survives. Unlike OpenCLIP's, it works
with --remote-sync and --resume latest: commits are atomic, so nothing half-written is copied.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bigclip.checkpoint import LATEST, CheckpointStore, Manifest, catalog, keep_last_for
from bigclip.checkpoint.mirror import MOST_RECENT_ONLY
from bigclip.config import TrainConfig
from bigclip.data.tokenizer import check_tokenizer, saved_tokenizer
from bigclip.distributed import Runtime
from bigclip.engines import Engine
from bigclip.errors import ConfigError
from bigclip.storage.redact import redact
from bigclip.train.metrics import get_logger
from bigclip.train.remote_sync import RemoteSync
from bigclip.weights.openclip_resume import is_openclip_checkpoint, load_openclip_checkpoint


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch in progress (or next, when saved at an epoch end)
    epoch_step: int = 0  # optimizer steps into that epoch
    samples_seen: int = 0


def checkpoint_root(cfg: TrainConfig, run_dir: Path) -> str:
    return cfg.checkpoint.checkpoint_dir or str(run_dir / "checkpoints")


def open_store(cfg: TrainConfig, run_dir: Path) -> CheckpointStore:
    """Collective; the access check fails in seconds (wrong bucket, no credentials) before any model."""
    root = checkpoint_root(cfg, run_dir)
    store = CheckpointStore(root, keep_last=keep_last_for(cfg.checkpoint, root))
    store.check_access()
    return store


def attach(store: CheckpointStore, cfg: TrainConfig, sync: RemoteSync | None) -> None:
    """Rank 0: what happens after each commit (--save-most-recent pruning, waking the remote
    sync) and which checkpoints local retention must keep (those not yet backed up); then
    starts the sync."""
    if store.group.rank != 0:
        return
    pruner = MostRecentPruner(store) if cfg.checkpoint.save_most_recent else None
    if sync is not None and sync.mirror is not None:
        store.keep = sync.mirror.needed  # pruned once backed up: the sync prunes after each copy
        if store.keep_last > 0:
            sync.on_backed_up = lambda: store.apply_retention(keep_last=store.keep_last)

    def on_commit(folder: str, manifest: Manifest) -> None:
        if pruner is not None:
            pruner.committed(folder, manifest)
        if sync is not None:
            sync.notify()

    store.on_commit = on_commit
    if sync is not None:
        sync.start()


class MostRecentPruner:
    """Deletes a --save-most-recent-only checkpoint once a newer one is committed (rank 0)."""

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


def save_due(cfg: TrainConfig, state: TrainState, *, epoch_end: bool, final: bool) -> bool:
    """Whether to checkpoint now, for any reason (`regular_save_due`: whether it is kept)."""
    return regular_save_due(cfg, state, epoch_end=epoch_end, final=final) or (
        cfg.checkpoint.save_most_recent and (epoch_end or final)
    )


def regular_save_due(cfg: TrainConfig, state: TrainState, *, epoch_end: bool, final: bool) -> bool:
    """The saves that are kept: --save-frequency epochs, --save-every-n-steps, the final one."""
    c = cfg.checkpoint
    if final:
        return c.save_frequency > 0 or c.save_every_n_steps > 0
    if epoch_end:
        return c.save_frequency > 0 and state.epoch % c.save_frequency == 0
    return c.save_every_n_steps > 0 and state.step % c.save_every_n_steps == 0


def _gather(value: Any, world: int) -> list[Any]:
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _rng_state(device: torch.device) -> dict[str, Any]:
    """JSON-able, so the gathered list is one opaque value whatever the world size."""
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": _b64(torch.cuda.get_rng_state(device)) if device.type == "cuda" else None,
        "python": list(random.getstate()[1]),
    }


def _restore_rng(saved: list[dict], runtime: Runtime, *, seed: int, step: int) -> None:
    if runtime.rank >= len(saved):
        torch.manual_seed(seed + 100_003 * step + runtime.rank)
        random.seed(seed + 100_003 * step + runtime.rank)
        return
    mine = saved[runtime.rank]
    torch.set_rng_state(_unb64(mine["torch"]))
    if mine["cuda"] is not None and runtime.device.type == "cuda":
        torch.cuda.set_rng_state(_unb64(mine["cuda"]), runtime.device)
    random.setstate((3, tuple(mine["python"]), None))


def checkpoint_contents(
    engine: Engine, cfg: TrainConfig, state: TrainState, runtime: Runtime, data_position: dict | None
) -> dict[str, Any]:
    """The dict DCP saves (and, on resume, loads into: it must hold every key to restore)."""
    train = {
        **asdict(state),
        "data": json.dumps(data_position),
        "rng": json.dumps(_gather(_rng_state(runtime.device), runtime.world_size)),
        "config": json.dumps(redact(cfg.to_dict())),
    }
    return {**engine.checkpoint_state(), "train": train}


def manifest_meta(
    cfg: TrainConfig, runtime: Runtime, global_batch: int, *, most_recent_only: bool = False
) -> dict[str, Any]:
    meta = {
        "engine": cfg.engine.engine,
        "model": cfg.model.model,
        "global_batch": global_batch,
        "tokenizer": cfg.data.tokenizer,  # the ids the weights learned (checked on --resume/--pretrained)
    }
    return {**meta, MOST_RECENT_ONLY: True} if most_recent_only else meta


def resume(
    store: CheckpointStore,
    engine: Engine,
    cfg: TrainConfig,
    runtime: Runtime,
    global_batch: int,
    *,
    which: str,
) -> tuple[TrainState, dict | None]:
    """Load `which` (from `backup.resume_target`) in place; returns the train state and the data
    position (None: epoch start)."""
    if is_openclip_checkpoint(which):
        return _resume_openclip(store, engine, cfg, runtime), None
    contents = checkpoint_contents(engine, cfg, TrainState(), runtime, None)
    # --resume latest (resolved to a URI by backup.resume_target) skips a damaged checkpoint for
    # the next older one; an explicit path never falls back.
    manifest = store.load(contents, which, fall_back=cfg.checkpoint.resume == LATEST)
    train = contents["train"]
    _check_compatible(manifest.meta, cfg, global_batch, uri=manifest.uri)
    _check_tokenizer(saved_tokenizer(manifest.meta, json.loads(train["config"])), cfg, uri=manifest.uri)
    state = TrainState(**{k: int(train[k]) for k in asdict(TrainState())})
    _restore_rng(json.loads(train["rng"]), runtime, seed=cfg.optim.seed, step=state.step)
    get_logger().info(
        f"resumed {manifest.uri} at step {state.step} (epoch {state.epoch}), saved at "
        f"{manifest.world_size} rank(s), now {runtime.world_size}"
    )
    return state, json.loads(train["data"])


def _resume_openclip(
    store: CheckpointStore, engine: Engine, cfg: TrainConfig, runtime: Runtime
) -> TrainState:
    """OpenCLIP's epoch_N.pt: weights, AdamW state and epoch (see weights/openclip_resume.py)."""
    if store.latest() is not None:
        get_logger().warning(
            f"--resume {cfg.checkpoint.resume} starts over from the OpenCLIP checkpoint although this run "
            f"has committed checkpoints ({store.latest()}); after a preemption, requeue with --resume latest"
        )
    plan = load_openclip_checkpoint(engine, cfg, runtime, cfg.checkpoint.resume)
    get_logger().info(
        f"resumed OpenCLIP checkpoint {cfg.checkpoint.resume}: {len(plan.weights)} weights, AdamW state of "
        f"{len(plan.moments)} (its step count {plan.adam_step}), continuing with epoch {plan.epoch}. Not "
        "carried over: " + "; ".join(plan.notes)
    )
    # The step follows from the epoch once this run's batches per epoch are known (`at_epoch_start`).
    return TrainState(epoch=plan.epoch)


def at_epoch_start(state: TrainState, *, steps_per_epoch: int, global_batch: int) -> None:
    """Place a run resumed from an OpenCLIP checkpoint at the start of its epoch, as OpenCLIP's
    trainer does: step = epoch x optimizer steps per epoch under the current flags (its
    `num_batches_per_epoch * epoch`), so the LR schedule and the step budget continue from the
    right place at any global batch. AdamW's own step count, loaded with the moments, only
    drives its bias correction: at another global batch it is not the run's step."""
    state.step = state.epoch * steps_per_epoch
    state.epoch_step = 0
    state.samples_seen = state.step * global_batch


def check_resume_target(store: CheckpointStore, cfg: TrainConfig, which: str, *, global_batch: int) -> None:
    """Collective, before any model is built: what the checkpoint's manifest can settle in
    milliseconds (model, global batch, tokenizer). A manifest that cannot be read is left to
    `store.load`, which names the damage (and, for --resume latest, skips it)."""
    if not which or is_openclip_checkpoint(which):
        return
    meta = store.group.on_rank0(lambda: store.manifest_meta(which))
    if meta is None:
        return
    uri, meta = meta
    _check_compatible(meta, cfg, global_batch, uri=uri)
    _check_tokenizer(saved_tokenizer(meta), cfg, uri=uri)


def _check_tokenizer(saved: str, cfg: TrainConfig, *, uri: str) -> None:
    check_tokenizer(
        saved, cfg.data.tokenizer, allow=cfg.checkpoint.allow_tokenizer_change, what=f"--resume {uri}"
    )


def _check_compatible(meta: dict[str, Any], cfg: TrainConfig, global_batch: int, *, uri: str) -> None:
    saved_model = meta.get("model")
    if saved_model and saved_model != cfg.model.model:
        raise ConfigError(
            f"--resume {uri}: the checkpoint is of model {saved_model}, this run builds {cfg.model.model}; "
            f"pass --model {saved_model}, or start from its weights with --pretrained"
        )
    saved_batch = int(meta.get("global_batch", global_batch))
    if saved_batch != global_batch and not cfg.checkpoint.allow_batch_size_change:
        raise ConfigError(
            f"--resume {uri}: the checkpoint was trained with global batch {saved_batch}, this run has {global_batch} "
            "(--batch-size x --accum-freq x ranks); change --batch-size to keep it, or pass "
            "--allow-batch-size-change to continue with the new one"
        )
