"""--resume: the checks a checkpoint's manifest settles before any model is built, and loading
the model, optimizer, train state, data position and RNG in place (a bigclip checkpoint at any
world size, or OpenCLIP's epoch_N.pt).
"""

from __future__ import annotations

import json
from typing import Any

from bigclip.checkpoint import LATEST, CheckpointStore, Manifest
from bigclip.config import TrainConfig
from bigclip.data.resume.rank_state import continues_alone, merge_rank_states
from bigclip.data.tokenizer import check_tokenizer, saved_tokenizer
from bigclip.distributed import Runtime
from bigclip.engines import Engine
from bigclip.errors import ConfigError
from bigclip.models.families import model_shape
from bigclip.models.run_options import image_size
from bigclip.models.shape import ModelOptions
from bigclip.storage.locations import open_parent
from bigclip.train.checkpoint_contents import LEGACY_KEYS, CheckpointContents, TrainState, loaded_state
from bigclip.train.metrics import get_logger
from bigclip.weights.openclip_resume import is_openclip_checkpoint, load_openclip_checkpoint


def resume(
    store: CheckpointStore, contents: CheckpointContents, *, which: str
) -> tuple[TrainState, dict | None, Manifest | None]:
    """Load `which` (from `backup.resume_target`) in place; returns the train state, the data
    position (None: epoch start) and the manifest (None for an OpenCLIP checkpoint)."""
    engine, cfg, runtime = contents.engine, contents.cfg, contents.runtime
    if is_openclip_checkpoint(which):
        return _resume_openclip(store, engine, cfg, runtime), None, None
    target = contents.load_target()
    # --resume latest (resolved to a URI by backup.resume_target) skips a damaged checkpoint for
    # the next older one; an explicit path never falls back.
    manifest = store.load(target, which, fall_back=cfg.checkpoint.resume == LATEST, optional_keys=LEGACY_KEYS)
    train = target["train"]
    _check_compatible(manifest.meta, cfg, contents.global_batch, uri=manifest.uri)
    _check_tokenizer(saved_tokenizer(manifest.meta, json.loads(train["config"])), cfg, uri=manifest.uri)
    state, own = loaded_state(train, store.rank_state(manifest, runtime.rank), runtime, seed=cfg.optim.seed)
    position = _data_position(store, manifest, own, cfg, runtime)
    get_logger().info(
        f"resumed {manifest.uri} at step {state.step} (epoch {state.epoch}), saved at "
        f"{manifest.world_size} rank(s), now {runtime.world_size}"
    )
    return state, position, manifest


def _data_position(
    store: CheckpointStore, manifest: Manifest, own: dict | None, cfg: TrainConfig, runtime: Runtime
) -> dict | None:
    """Collective: where this rank's data continues. At the saved settings every rank continues
    its own stream from its own record; otherwise (another world size, more workers...) rank 0
    merges every saved rank's state into the epoch's position, world-size free, and broadcasts
    it: the only read of the whole world's states, and only when the layout of readers changed."""
    if not manifest.layout:  # older checkpoints hold the merged position, the same on every rank
        return own
    alone = own is not None and continues_alone(
        own, world_size=runtime.world_size, workers=cfg.data.workers, batch_size=cfg.data.batch_size,
        interleave=cfg.data.shard_interleave, seed=cfg.optim.seed,
    )  # fmt: skip
    answers = store.group.gather(alone)

    def decide() -> tuple[str, dict | None]:
        if own is None:  # saved at an epoch's end: the next one starts afresh
            return "start", None
        if all(answers):
            return "own", None
        states = [store.rank_state(manifest, k)["data"] for k in range(manifest.world_size)]
        get_logger().info(
            f"data position: merging the {len(states)} saved ranks' positions (the readers changed)"
        )
        return "merged", merge_rank_states(states)

    kind, merged = store.group.on_rank0(decide)
    return own if kind == "own" else merged


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
    # The step follows from the epoch when this run's batches per epoch are known (`at_epoch_start`).
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
    if is_openclip_checkpoint(which):
        store.group.on_rank0(lambda: _check_file_exists(which))
        return
    if not which:
        return
    meta = store.group.on_rank0(lambda: store.manifest_meta(which))
    if meta is None:
        return
    uri, meta, step = meta
    _check_compatible(meta, cfg, global_batch, uri=uri)
    _check_tokenizer(saved_tokenizer(meta), cfg, uri=uri)
    if which != LATEST and not cfg.evaluates_only:  # (latest passes newer ones only if they are damaged)
        newer = store.group.on_rank0(lambda: [u for s, u in store.committed() if s > step])
        if newer:
            raise ConfigError(
                f"--resume {uri} (step {step}): this run's checkpoint folder {store.root} holds {len(newer)} newer "
                f"committed checkpoint(s) ({', '.join(u.rsplit('/', 1)[-1] for u in newer[:3])}), which its saves "
                "would overwrite; to roll back, move them elsewhere first, or give this run another "
                "--checkpoint-dir or --name"
            )


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
    _check_image_size(meta, cfg, uri=uri)
    saved_loss = meta.get("loss")  # absent before checkpoints recorded it: the load names the logit bias
    if saved_loss and saved_loss != cfg.loss.loss:
        raise ConfigError(
            f"--resume {uri}: the checkpoint was trained with --loss {saved_loss}, this run has --loss "
            f"{cfg.loss.loss} (its model {'has' if cfg.loss.loss == 'siglip' else 'has no'} a logit bias); resume "
            f"with --loss {saved_loss}, or start from its weights with --pretrained"
        )
    saved_batch = int(meta.get("global_batch", global_batch))
    # An evaluation-only run takes no step: the batch it evaluates with changes nothing.
    if saved_batch != global_batch and not (cfg.checkpoint.allow_batch_size_change or cfg.evaluates_only):
        raise ConfigError(
            f"--resume {uri}: the checkpoint was trained with global batch {saved_batch}, this run has {global_batch} "
            "(--batch-size x --accum-freq x ranks); change --batch-size to keep it, or pass "
            "--allow-batch-size-change to continue with the new one"
        )


def _check_image_size(meta: dict[str, Any], cfg: TrainConfig, *, uri: str) -> None:
    """The positional embedding's shape follows the image size: another size is not another model."""
    saved = meta.get("image_size")
    if not saved:
        return  # written before checkpoints recorded it: the load names the shapes that differ
    size = image_size(cfg)
    if int(saved) != size:
        default = model_shape(cfg.model.model, ModelOptions(cache_dir=cfg.model.cache_dir)).image_size
        fix = f"--force-image-size {saved}" if int(saved) != default else "no --force-image-size"
        raise ConfigError(
            f"--resume {uri}: the checkpoint was trained at image size {saved}, this run builds {cfg.model.model} "
            f"at {size}{' (--force-image-size)' if cfg.model.force_image_size else ''}; resume with {fix}, or "
            "start from its weights at the new size with --pretrained"
        )


def _check_file_exists(uri: str) -> None:
    """An OpenCLIP epoch_N.pt is read after the model is built: one that is not there fails now."""
    parent, name = open_parent(uri)
    if not parent.exists(name):
        raise ConfigError(
            f"--resume {uri}: not found; give an OpenCLIP epoch_N.pt that exists, a bigclip checkpoint folder "
            "(LOGS/NAME/checkpoints/step_N), or --resume latest"
        )
