"""Everything a run does once before its first step, cheapest checks first: flags, machine,
process group, run folder, data, storage, resume target; then the engine and the model.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bigclip import data
from bigclip.config import EngineConfig, TrainConfig
from bigclip.distributed import init_distributed
from bigclip.engines import build_engine
from bigclip.models.from_config import build_model, model_config, model_factory
from bigclip.ops.loss.contrastive import build_loss
from bigclip.storage.settings import configure_storage
from bigclip.train.backup import prepare_backup
from bigclip.train.checkpoint_contents import CheckpointContents
from bigclip.train.checkpointer import Checkpointer, open_store
from bigclip.train.metrics import Scalars
from bigclip.train.preemption import PreemptionWatcher
from bigclip.train.preflight import check_flags, check_machine
from bigclip.train.resume import check_resume_target, resume
from bigclip.train.run import Guards, Progress, Run
from bigclip.train.run_dir import open_run_dir, prepare_run_dir, start_logging
from bigclip.train.run_lock import RunLock
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
    text_cfg = model_config(cfg).text_cfg
    return data.build_tokenizer(
        cfg.data.tokenizer, context_length=text_cfg.context_length, vocab_size=text_cfg.vocab_size
    )


def build_weights(
    cfg: TrainConfig, runtime: Runtime, store: CheckpointStore, *, resuming: bool
) -> tuple[Engine, HeldLease | None]:
    """The engine with the model built in it, and its --pretrained weights unless resuming (the
    registry lease held while they are in use, on rank 0, for --pretrained registry:NAME)."""
    engine = build_engine(cfg, runtime)
    engine.build(build_model(cfg), rebuild=model_factory(cfg))
    # --resume wins over --pretrained: a resumed run does not read the initial weights at all.
    applies = not resuming and pretrained.applies(cfg, store)
    return engine, pretrained.load_pretrained(engine, cfg, runtime) if applies else None


def resumed_progress(store: CheckpointStore, contents: CheckpointContents, *, which: str) -> Progress:
    """Where the run starts: step 0, or what --resume `which` loads (in place, with the weights)."""
    progress = Progress()
    if which:
        progress.state, progress.data_position = resume(store, contents, which=which)
        progress.step_from_epoch = is_openclip_checkpoint(which)
    return progress


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
    log = start_logging(cfg.log, run_dir, runtime)
    seed_everything(cfg.optim.seed, runtime.rank)
    apply_preprocess(cfg, log)  # a --pretrained tag's or hf-hub model's image mean/std
    tokenizer = build_tokenizer(cfg)
    configure_storage(s3_endpoint=cfg.checkpoint.s3_endpoint, s3_region=cfg.checkpoint.s3_region)
    shards = data.validate_data(cfg.data, world_size=runtime.world_size)
    zeroshot = ZeroShot.open(cfg)
    store = open_store(cfg, run_dir)
    run_lock = RunLock(run_dir)
    store.group.on_rank0(run_lock.hold_if_exists)  # another run in this folder: refused before the checks
    sync, which = prepare_backup(cfg, run_dir, store)  # which: what --resume loads ('' for nothing)
    check_resume_target(
        store, cfg, which, global_batch=cfg.data.batch_size * cfg.optim.accum_freq * runtime.world_size
    )
    store.group.on_rank0(run_lock.take)  # two new runs of one name racing: the second is refused here
    open_run_dir(cfg, run_dir, runtime)  # the checks passed: the folder, config.yaml, out.log
    log.info(
        f"run {cfg.log.name}: {runtime.world_size} rank(s), engine {cfg.engine.engine}, model {cfg.model.model}, "
        f"rank 0 on {runtime.device}"
    )
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
        pause=guards.watchdog.paused, verify=lambda step: verify_inputs(loss_fn, step=step),
    )  # fmt: skip
    return Run(cfg, runtime, run_dir, engine, loss_fn, tokenizer, shards, checkpointer, scalars, guards,
               progress, zeroshot)  # fmt: skip
