"""Everything a run does once before its first step, cheapest checks first: flags, machine,
process group, run folder, data, storage, resume target; then the engine and the model.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bigclip import data
from bigclip.config import EngineConfig, TrainConfig
from bigclip.distributed import init_distributed
from bigclip.engines import build_engine
from bigclip.errors import ConfigError
from bigclip.models.from_config import build_model, model_config, model_factory
from bigclip.ops.loss.contrastive import build_loss
from bigclip.storage.progress import human_bytes
from bigclip.storage.settings import configure_storage
from bigclip.train.backup import prepare_backup
from bigclip.train.checkpoint_contents import CheckpointContents
from bigclip.train.checkpointer import Checkpointer, open_store
from bigclip.train.metrics import Scalars
from bigclip.train.phases import QUIET_S, OnStop, phase, since_start
from bigclip.train.preemption import PreemptionWatcher
from bigclip.train.preflight import check_flags, check_machine
from bigclip.train.resume import check_resume_target, resume
from bigclip.train.run import Guards, Progress, Run
from bigclip.train.run_dir import open_run_dir, prepare_run_dir, start_logging
from bigclip.train.run_lock import RunLock
from bigclip.train.signals import preemption_flag
from bigclip.train.step import verify_inputs
from bigclip.train.watchdog import StepWatchdog
from bigclip.train.zeroshot import ZeroShot
from bigclip.weights import pretrained
from bigclip.weights.named import apply_preprocess
from bigclip.weights.openclip_resume import is_openclip_checkpoint

if TYPE_CHECKING:
    from bigclip.checkpoint import CheckpointStore
    from bigclip.distributed import Runtime
    from bigclip.engines import Engine
    from bigclip.registry.leases import HeldLease  # only with --pretrained registry:NAME


def seed_everything(seed: int, rank: int) -> None:
    """Different streams per rank (patch dropout, augmentation), as OpenCLIP's random_seed()."""
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)
    random.seed(seed + rank)


def requested_device(engine: EngineConfig) -> str:
    """--device, else with --no-set-device-rank the first visible GPU (OpenCLIP: cuda:0, for one
    GPU per process), else '' (cuda:LOCAL_RANK, or the CPU)."""
    if engine.device or engine.set_device_rank or not torch.cuda.is_available():
        return engine.device
    return "cuda:0"


def build_tokenizer(cfg: TrainConfig) -> Any:
    t = model_config(cfg).text_cfg
    return data.build_tokenizer(
        cfg.data.tokenizer, context_length=t.context_length, vocab_size=t.vocab_size, text_pool=t.pool_type,
        hf_name=t.hf_tokenizer_name, hf_kwargs=t.tokenizer_kwargs, cache_dir=cfg.model.cache_dir,
        model=cfg.model.model,
    )  # fmt: skip


def build_weights(
    cfg: TrainConfig, runtime: Runtime, store: CheckpointStore, *, resuming: bool
) -> tuple[Engine, HeldLease | None]:
    """The engine with the model built in it, and its --pretrained weights unless resuming (the
    registry lease held while they are in use, on rank 0, for --pretrained registry:NAME)."""
    # --resume wins over --pretrained: a resumed run does not read the initial weights at all.
    applies = not resuming and pretrained.applies(cfg, store)
    weights = f", then --pretrained {cfg.model.pretrained}" if applies else ""
    detail = f"{cfg.model.model} under {cfg.engine.engine} on {runtime.world_size} rank(s){weights}"
    with phase("building the model", on_stop=OnStop.EXIT_NOW, detail=detail):
        engine = build_engine(cfg, runtime)
        engine.build(build_model(cfg), rebuild=model_factory(cfg))
        return engine, pretrained.load_pretrained(engine, cfg, runtime) if applies else None


def resumed_progress(store: CheckpointStore, contents: CheckpointContents, *, which: str) -> Progress:
    """Where the run starts: step 0, or what --resume `which` loads (in place, with the weights)."""
    progress = Progress()
    if which:
        with phase(f"reading checkpoint {which}", on_stop=OnStop.EXIT_NOW) as reading:
            progress.state, progress.data_position, manifest = resume(store, contents, which=which)
            if manifest is not None:
                reading.progress = lambda: human_bytes(manifest.total_bytes)  # in its end line
                progress.saved_schedule = dict(manifest.meta.get("schedule") or {})
        progress.step_from_epoch = is_openclip_checkpoint(which)
    preemption_flag().note(step=progress.state.step)
    return progress


def check_weights_to_evaluate(cfg: TrainConfig, store: CheckpointStore, which: str) -> None:
    """An evaluation-only run whose --resume latest finds nothing (and has no --pretrained to fall
    back on) would evaluate freshly initialised weights: refused. `which` and the store's listing
    agree on every rank, so every rank raises together."""
    if which or pretrained.applies(cfg, store):
        return
    raise ConfigError(
        f"--resume {cfg.checkpoint.resume}: {store.root} holds no committed checkpoint, so this evaluation-only "
        "run has no weights to evaluate; name a checkpoint with --resume PATH, or give --pretrained"
    )


@contextmanager
def saving(
    pause: Callable[[], AbstractContextManager[Any]], progress: Progress, *, synchronous: bool
) -> Iterator[None]:
    """Around each checkpoint save (the Checkpointer's `pause`): the step watchdog pauses, and a
    synchronous save says when it starts (training waits for it; its end line is the
    Checkpointer's); an async save's staging speaks only if it takes long."""
    options: dict[str, Any] = {"detail": "synchronous: training waits until it is committed"}
    if not synchronous:
        options = {"announce": False, "quiet_s": QUIET_S}
    with pause(), phase(f"saving checkpoint step {progress.state.step}", **options) as saving_phase:
        yield
        saving_phase.announced = False  # the Checkpointer's line ends it ("... training blocked N s")


def setup(cfg: TrainConfig) -> Run:
    """Check everything that can fail cheaply (data, storage) before building the model."""
    check_flags(cfg)
    check_machine(cfg)  # before the process group: the device, world size, DeepSpeed's accelerator
    preemption = PreemptionWatcher()
    runtime = init_distributed(
        backend=cfg.engine.dist_backend,
        device=requested_device(cfg.engine),
        timeout_s=cfg.engine.dist_timeout,
    )
    run_dir = prepare_run_dir(cfg, runtime)
    preemption.flag.note(run_dir=run_dir, is_main=runtime.is_main)  # for a stop before the first step
    log = start_logging(cfg.log, run_dir, runtime)
    seed_everything(cfg.optim.seed, runtime.rank)
    apply_preprocess(cfg, log)  # a --pretrained tag's or hf-hub model's image mean/std
    tokenizer = build_tokenizer(cfg)
    configure_storage(s3_endpoint=cfg.checkpoint.s3_endpoint, s3_region=cfg.checkpoint.s3_region)
    shards = data.validate_data(cfg.data, world_size=runtime.world_size, evaluation_only=cfg.evaluates_only)
    zeroshot = ZeroShot.open(cfg)
    store = open_store(cfg, run_dir)
    run_lock = RunLock(run_dir)
    store.group.on_rank0(run_lock.hold_if_exists)  # another run in this folder: refused before the checks
    sync, which = prepare_backup(cfg, run_dir, store)  # which: what --resume loads ('' for nothing)
    check_resume_target(
        store, cfg, which, global_batch=cfg.data.batch_size * cfg.optim.accum_freq * runtime.world_size
    )
    if cfg.evaluates_only:
        check_weights_to_evaluate(cfg, store, which)
    store.group.on_rank0(run_lock.take)  # two new runs of one name racing: the second is refused here
    open_run_dir(cfg, run_dir, runtime)  # the checks passed: the folder, config.yaml, out.log
    if not which:
        preemption.flag.note(step=0)  # for a stop before the first step (else known once resumed)
    log.info(
        f"run {cfg.log.name}: {runtime.world_size} rank(s), engine {cfg.engine.engine}, model {cfg.model.model}, "
        f"rank 0 on {runtime.device}"
    )
    log.info(f"start-up: done in {since_start():.1f} s")
    engine, lease = build_weights(cfg, runtime, store, resuming=bool(which))
    contents = CheckpointContents(engine, cfg, runtime)
    progress = resumed_progress(store, contents, which=which)
    guards = Guards(preemption, StepWatchdog.start_for(cfg, runtime, run_dir), lease, run_lock)
    scalars = Scalars.open(cfg, run_dir=run_dir, is_main=runtime.is_main)
    loss_fn = build_loss(cfg.loss)
    checkpointer = Checkpointer(
        store, contents, cfg=cfg.checkpoint, preemption=preemption, scalars=scalars, sync=sync,
        # never saved again over the checkpoint just loaded (an OpenCLIP .pt is not in the store)
        saved_step=progress.state.step if which and not progress.step_from_epoch else -1,
        pause=lambda: saving(guards.watchdog.paused, progress, synchronous=not cfg.checkpoint.async_save),
        verify=lambda step: verify_inputs(loss_fn, step=step),
    )  # fmt: skip
    contents.schedule = progress.schedule_record
    return Run(cfg, runtime, run_dir, engine, loss_fn, tokenizer, shards, checkpointer, scalars, guards,
               progress, zeroshot)  # fmt: skip
