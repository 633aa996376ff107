"""The trainer, top to bottom: setup -> the loop -> one step -> saving and stopping.

    python -m bigclip.train --model ViT-B-32 --train-data '/data/{00000..00999}.tar' ...
    torchrun --nproc-per-node 8 -m bigclip.train -- --model ViT-B-32 ...   (`--` keeps torchrun
        from reading bigclip's --logs as its own --logs-specs)
    deepspeed --num_gpus 8 --module bigclip.train --engine deepspeed --deepspeed-config ds_configs/zero3.json ...

The door in front of it (entry.py) parses and checks the flags and the machine, once, before
anything here runs; `train` then sets the run up (process group, run folder, data, storage, the
resume target: the cheap checks before the model is built), fits it (or, with no --train-data,
evaluates it) and closes it. Nothing here depends on which engine shards the model: the loop only
calls the Engine verbs. What a step does around the engine, how a checkpoint is written
(checkpointer.py), what is evaluated (evaluate.py) and how stop signals reach the loop
(signals.py, preemption.py) live in their own modules.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from bigclip.config import EngineConfig, TrainConfig
from bigclip.data.device import image_normalizer
from bigclip.data.loader import TrainLoader
from bigclip.data.shards import ShardList
from bigclip.data.tokenizer import build_tokenizer as build_data_tokenizer
from bigclip.data.train_data import TrainData
from bigclip.data.validation import validate_data
from bigclip.distributed import cpu_group, init_distributed
from bigclip.engines import build_engine
from bigclip.engines.base import Engine, StepStats
from bigclip.engines.compile import compile_activity
from bigclip.errors import ConfigError, NonFiniteLossError
from bigclip.models.families import family_of
from bigclip.models.from_config import build_model, model_factory
from bigclip.models.run_options import image_size, model_options
from bigclip.ops.loss.contrastive import build_loss
from bigclip.storage.progress import human_bytes
from bigclip.storage.settings import configure_storage
from bigclip.train import throughput
from bigclip.train.backup import prepare_backup
from bigclip.train.checkpoint_contents import CheckpointContents, TrainState
from bigclip.train.checkpointer import Checkpointer, SaveFailed, open_store
from bigclip.train.evaluate import held_out_retrieval, val_due
from bigclip.train.metrics import (
    LOSS_NAME,
    Average,
    Scalars,
    StepTimer,
    get_logger,
    peak_memory_gb,
    train_log_line,
)  # fmt: skip
from bigclip.train.phases import QUIET_S, OnStop, begin, phase, since_start
from bigclip.train.preemption import REQUEUE_EXIT_CODE, Preempted, announce_requeue
from bigclip.train.resume import at_epoch_start, check_resume_target, resume
from bigclip.train.run_dir import open_run_dir, prepare_run_dir, start_logging
from bigclip.train.run_lock import RunLock
from bigclip.train.schedule import lr_at, resume_note, run_horizon, schedule_line, warmup_warning
from bigclip.train.signals import SignalFlag, catch_preemption_signals, preemption_flag
from bigclip.train.watchdog import StepWatchdog
from bigclip.train.zeroshot import ZeroShot
from bigclip.weights import pretrained
from bigclip.weights.openclip_resume import is_openclip_checkpoint

if TYPE_CHECKING:
    from bigclip.checkpoint import CheckpointStore
    from bigclip.distributed import Runtime
    from bigclip.registry.leases import HeldLease  # only with --pretrained registry:NAME
    from bigclip.train.phases import Phase


# --- What a run carries ---------------------------------------------------------------------------


@dataclass
class Guards:
    """What watches the run from outside its steps, released together when it ends."""

    preemption: SignalFlag
    watchdog: StepWatchdog
    lease: HeldLease | None = None  # on rank 0, with --pretrained registry:NAME
    run_lock: RunLock | None = None  # held on rank 0: the run folder is this run's

    def close(self) -> None:
        self.watchdog.close()
        self.preemption.close()
        if self.lease is not None:
            self.lease.release()
        if self.run_lock is not None:
            self.run_lock.release()


@dataclass
class Progress:
    """How far the run is: the saved train state and what the loop derives around it."""

    state: TrainState = field(default_factory=TrainState)
    data_position: dict | None = None  # where the data stream resumes in the current epoch
    total_steps: int = 0  # the horizon: the step the run ends at (schedule.run_horizon)
    steps_per_epoch: int = 0  # planned optimizer steps per epoch (the LR schedule's cooldown uses it)
    last_loss: float | None = None  # the global loss at the latest log step
    last_lr: float = 0.0  # the LR of the latest step (recorded in each checkpoint's manifest)
    step_from_epoch: bool = False  # resumed from OpenCLIP: fit sets the step from the epoch
    saved_schedule: dict = field(default_factory=dict)  # the resumed checkpoint's (schedule.saved_schedule)
    first_step: Phase | None = None  # open from the loop's start until a step completes

    def schedule_record(self) -> dict[str, float]:
        """For the manifest of a checkpoint saved now: the schedule's horizon and the last LR."""
        return {"end_step": self.total_steps, "lr": self.last_lr} if self.total_steps else {}


@dataclass
class Run:
    """What the loop carries around."""

    cfg: TrainConfig
    runtime: Runtime
    run_dir: Path
    engine: Engine
    loss_fn: torch.nn.Module
    tokenizer: Any
    shards: ShardList
    checkpointer: Checkpointer
    scalars: Scalars  # --report-to: TensorBoard, wandb
    guards: Guards
    progress: Progress
    zeroshot: ZeroShot = field(default_factory=ZeroShot)  # --imagenet-val / --imagenet-v2

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.cfg.optim.accum_freq * self.runtime.world_size


# --- Setup: everything a run does once before its first step, cheapest checks first ---------------


def setup(cfg: TrainConfig) -> Run:
    """Check everything that can fail cheaply (data, storage) before building the model. The flags
    and the machine were checked at the door (entry.py), before torch and the process group."""
    preemption = catch_preemption_signals()  # idempotent: a signal caught since entry.py installed it is kept
    runtime = init_distributed(
        backend=cfg.engine.dist_backend,
        device=requested_device(cfg.engine),
        timeout_s=cfg.engine.dist_timeout,
    )
    run_dir = prepare_run_dir(cfg, runtime)
    preemption.note(run_dir=run_dir, rank=runtime.rank)  # for a stop before the first step
    log = start_logging(cfg.log, run_dir, runtime)
    seed_everything(cfg.optim.seed, runtime.rank)
    pretrained.apply_preprocess(cfg, log)  # e.g. a --pretrained tag's or hf-hub model's image mean/std
    tokenizer = build_tokenizer(cfg)
    configure_storage(s3_endpoint=cfg.checkpoint.s3_endpoint, s3_region=cfg.checkpoint.s3_region)
    shards = validate_data(cfg.data, world_size=runtime.world_size, evaluation_only=cfg.evaluates_only)
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
        preemption.note(step=0)  # for a stop before the first step (else known once resumed)
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
    text = family_of(cfg.model.model).tokenizer(cfg.model.model, model_options(cfg))
    return build_data_tokenizer(
        cfg.data.tokenizer, cache_dir=cfg.model.cache_dir, model=cfg.model.model, **text
    )


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


# --- The loop: epochs of steps, evaluation, the end -----------------------------------------------


def fit(run: Run) -> dict[str, Any]:
    with open_train_data(run) as train_data:
        return fit_epochs(run, train_data)


def fit_epochs(run: Run, train_data: TrainData) -> dict[str, Any]:
    cfg, progress, state = run.cfg, run.progress, run.progress.state
    loader = build_loader(run, train_data)
    progress.steps_per_epoch = max(1, loader.steps_per_epoch // cfg.optim.accum_freq)  # planned
    if progress.step_from_epoch:  # an OpenCLIP checkpoint: its epoch, at this run's steps per epoch
        at_epoch_start(state, steps_per_epoch=progress.steps_per_epoch, global_batch=run.global_batch)
        progress.step_from_epoch = False
    plan_schedule(run)
    # Nothing trained yet in this process: a stop signal ends it at once until a step completes.
    compiling = run.cfg.model.torchcompile
    progress.first_step = begin("the first step", on_stop=OnStop.EXIT_NOW, detail=first_step_detail(run),
                                progress=compile_activity().text if compiling else None)  # fmt: skip
    metrics = None
    while state.step < progress.total_steps and epochs_left(run):
        run.engine.train()
        if not train_one_epoch(run, loader):
            break  # step budget spent mid-epoch
        loader.account_epoch()  # collective: rank 0 logs what the epoch read against its plan, and what it lost
        loader.close()
        state.epoch, state.epoch_step, progress.data_position = state.epoch + 1, 0, None
        final = state.step >= progress.total_steps or not epochs_left(run)
        metrics = evaluate(run, retrieval=val_due(cfg, state.epoch), final=final) or metrics
        run.checkpointer.save_at_epoch_end(state)
        if not final:
            stop_at_epoch_end(run, loader)
            loader = build_loader(run, train_data)
    return finish(run, loader, metrics)


def open_train_data(run: Run) -> TrainData:
    """The run's data workers, started once: every epoch's loader runs on them."""
    # They are forked when the first epoch starts, and s3torchconnector tears its clients down
    # before a fork: an upload in flight must finish first. Later epochs fork nothing.
    wait_for_upload(run)
    return TrainData(
        run.cfg.data, rank=run.runtime.rank, world_size=run.runtime.world_size, seed=run.cfg.optim.seed,
        image_size=image_size(run.cfg), tokenizer=run.tokenizer, device=run.runtime.device,
        image_dtype=run.engine.image_dtype, shards=run.shards,
    )  # fmt: skip


def build_loader(run: Run, train_data: TrainData) -> TrainLoader:
    with between_steps(run):
        return train_data.epoch(run.progress.state.epoch, position=run.progress.data_position)


def plan_schedule(run: Run) -> None:
    """One horizon, the step the run ends at, for the LR schedule, the ETA and the log; rank 0
    says it, warns of a warmup the run never finishes, and notes a schedule that moved on resume."""
    cfg, progress, state = run.cfg.optim, run.progress, run.progress.state
    horizon = run_horizon(step=state.step, epoch=state.epoch, epoch_step=state.epoch_step,
                          steps_per_epoch=progress.steps_per_epoch, epochs=cfg.epochs, max_steps=cfg.max_steps)  # fmt: skip
    progress.total_steps = horizon.end_step
    progress.last_lr = float(progress.saved_schedule.get("lr", 0.0))
    if not run.runtime.is_main:
        return
    log, where = get_logger(), {"step": state.step, "steps_per_epoch": progress.steps_per_epoch}
    log.info(schedule_line(cfg, horizon, **where))
    warning = warmup_warning(cfg, horizon, **where)
    if warning:
        log.warning(warning)
    note = resume_note(cfg, horizon, progress.saved_schedule, **where)
    if note:
        (log.warning if note[1] else log.info)(note[0])


def epochs_left(run: Run) -> bool:
    """--epochs not yet done (--epochs below 1 sets no limit: --max-steps alone ends the run)."""
    return run.cfg.optim.epochs < 1 or run.progress.state.epoch < run.cfg.optim.epochs


def train_one_epoch(run: Run, loader: TrainLoader) -> bool:
    """Train until the epoch's data ends (True) or the step budget does (False, unless at the epoch end)."""
    cfg, progress, state = run.cfg, run.progress, run.progress.state
    timer, loss_avg = StepTimer(), Average()
    out, logged_at = None, state.step
    for group, keys in micro_batches(loader, k=cfg.optim.accum_freq):
        timer.data_ready()
        if cfg.log.batch_keys_file:
            record_batch_keys(run, keys)
        lr = lr_at(state.step, cfg.optim, progress.total_steps, steps_per_epoch=progress.steps_per_epoch)
        try:
            out = train_step(run.engine, run.loss_fn, group, lr=lr)
        except NonFiniteLossError as e:
            raise NonFiniteLossError(f"step {state.step}: {e}") from e
        progress.last_lr = lr
        if progress.first_step is not None:
            first_step_done(run)
        state.step, state.epoch_step = state.step + 1, state.epoch_step + 1
        state.samples_seen += run.global_batch
        timer.step_done()
        run.guards.watchdog.step_done(state.step)  # no sync: it only notes the time
        # OpenCLIP prints an epoch's last batch too
        last = state.step == progress.total_steps or state.epoch_step == progress.steps_per_epoch
        console = last or state.step % cfg.log.log_every_n_steps == 0
        if console or state.step % cfg.log.log_metric_every_n_steps == 0:  # as OpenCLIP main: both
            logged_at = state.step
            log_step(run, out, timer, loss_avg, lr, loader, console=console)
        if state.step >= progress.total_steps:  # ending with the epoch, it completes it (evaluated, saved)
            return state.epoch_step >= progress.steps_per_epoch
        signum = run.checkpointer.maybe_save(state, data_position=loader.rank_state)
        if signum:
            stop_for_requeue(run, loader, signum)
    if out is not None and logged_at != state.step:
        # The epoch ended before its planned last step, on every rank together, where a rank's data
        # ran out (the loader's collective check): its last step is logged all the same, and the
        # summary's loss is that step's, not an older one or none.
        log_step(run, out, timer, loss_avg, progress.last_lr, loader, console=True)
    return True


def micro_batches(loader: Any, *, k: int):
    """Group the loader's batches (already on the device) by k, the accumulation factor."""
    group, keys = [], []
    for batch in loader:
        group.append((batch.images, batch.texts))
        keys += batch.keys
        if len(group) == k:
            yield group, keys
            group, keys = [], []


def record_batch_keys(run: Run, keys: list[str]) -> None:
    path = f"{run.cfg.log.batch_keys_file}.rank{run.runtime.rank}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"step": run.progress.state.step, "keys": keys}) + "\n")


def first_step_done(run: Run) -> None:
    """From the first completed step on, a stop request checkpoints at a step boundary (before it,
    the rank leaves at once: signals.py). Raises StopRequested for one that came meanwhile."""
    run.progress.first_step.end()  # type: ignore[union-attr]
    run.progress.first_step = None
    begin("training", on_stop=OnStop.AT_BOUNDARY, announce=False, base=True)


def first_step_detail(run: Run) -> str:
    detail = "waiting for the first batch, then forward, backward and the optimizer step"
    if run.cfg.model.torchcompile:
        detail += "; --torchcompile: this step also compiles the model's blocks, which can take minutes"
    return detail


@contextmanager
def between_steps(run: Run) -> Iterator[None]:
    """Around loop work between steps that may take long (evaluation, building a loader): the step
    watchdog pauses, and so does the checkpointer's minutes-of-training clock."""
    with run.guards.watchdog.paused(), run.checkpointer.paused():
        yield


def evaluate(run: Run, *, retrieval: bool = True, final: bool = False) -> dict[str, float] | None:
    """Collective: zero-shot classification (when due) and held-out retrieval (with `retrieval`,
    given --val-data and --val-frequency), reported as OpenCLIP reports them; None if neither ran."""
    cfg = run.cfg.data
    retrieval = retrieval and bool(cfg.val_data) and bool(cfg.val_frequency)
    zeroshot = run.zeroshot.due(run.progress.state.epoch, final=final)
    if not retrieval and not zeroshot:
        return None
    normalize = image_normalizer(cfg, device=run.runtime.device, dtype=run.engine.image_dtype)
    metrics: dict[str, float] = {}
    what = " and ".join(["zero-shot classification"] * zeroshot + ["retrieval on --val-data"] * retrieval)
    with between_steps(run), phase("evaluation", detail=what):
        if zeroshot:
            wait_for_upload(run)  # its loader forks workers: s3torchconnector's clients go before a fork
            metrics |= run.zeroshot.evaluate(run.engine, run.tokenizer, run.runtime, normalize=normalize,
                                             batch_size=cfg.batch_size, workers=cfg.workers)  # fmt: skip
        if retrieval:
            metrics |= held_out_retrieval(
                run.engine,
                cfg,
                run.tokenizer,
                run.runtime,
                normalize=normalize,
                image_size=image_size(run.cfg),
            )
    if not metrics:
        return None
    state = run.progress.state
    metrics["epoch"], metrics["step"] = state.epoch, state.step
    if run.runtime.is_main:
        report(run, metrics)
    return metrics


def report(run: Run, metrics: dict[str, float]) -> None:
    """Rank 0: OpenCLIP's `Eval Epoch:` line, the `val/` scalars (at the step: bigclip evaluates
    mid-epoch too, at a --max-steps end) and one line of results.jsonl."""
    get_logger().info(
        f"Eval Epoch: {metrics['epoch']} " + "\t".join(f"{k}: {round(v, 4):.4f}" for k, v in metrics.items())
    )
    run.scalars.scalars({f"val/{k}": v for k, v in metrics.items()}, step=int(metrics["step"]))
    with open(run.run_dir / "results.jsonl", "a") as f:
        f.write(json.dumps(metrics) + "\n")


def finish(run: Run, loader: TrainLoader, metrics: dict | None) -> dict[str, Any]:
    state = run.progress.state
    begin("finishing", on_stop=OnStop.FINISH, announce=False, base=True)  # a stop now: the run completes
    run.guards.watchdog.close()  # no steps from here on (the last upload may take long)
    run.checkpointer.save_at_end(state, data_position=loader.rank_state)
    loader.close()
    if metrics is None or metrics["step"] != state.step:
        metrics = evaluate(run, final=True) or metrics  # the final weights get evaluated too
    wait_for_upload(run)  # the last upload must be committed before the run reports success
    latest = run.checkpointer.latest()
    with phase(
        "closing the run (the last upload, --remote-sync's final copy)", announce=False, quiet_s=QUIET_S
    ):
        close_run(run)
    return {
        "step": state.step,
        "epoch": state.epoch,
        "samples_seen": state.samples_seen,
        "loss": run.progress.last_loss,
        "eval": metrics,
        "run_dir": str(run.run_dir),
        "checkpoint": latest,
    }


def evaluate_only(run: Run) -> dict[str, Any]:
    """OpenCLIP's run without --train-data: evaluate the weights loaded (--pretrained, --resume)
    once, at the epoch they reached, and end."""
    metrics = evaluate(run, final=True)
    close_run(run)
    state = run.progress.state
    return {"step": state.step, "epoch": state.epoch, "eval": metrics, "run_dir": str(run.run_dir)}


# --- One optimizer step, and its log --------------------------------------------------------------
# OpenCLIP's `--accum-freq` feature caching: with K micro-batches, the features of all K are first
# computed without gradients and cached; then each micro-batch is run again with gradients and its
# loss is taken against the cached features of the others as negatives, so the contrastive batch is
# the full K x b local batch. Gradients of pass j reach only micro-batch j's features, so their sum
# over j is exactly the gradient of the full-batch loss. Two details make this exact rather than
# approximate: the logit scale/bias keep their gradient only in the last pass (otherwise it is
# counted K times, as in OpenCLIP); each re-run restores the RNG state of its cached pass, so patch
# dropout drops the same patches twice. Gradients sync across ranks only in the last pass.
#
# Values are tensors until a log step: reading a device tensor (`.item()`) waits for the GPU, so
# log_step runs only on log steps. The loss logged is the global one (averaged over ranks) and the
# loader capacity the slowest rank's, so every rank logs the same numbers on the same steps.


FEATURES = ("image_features", "text_features")


@dataclass
class StepOutput:
    loss: torch.Tensor  # this rank's loss, detached (reading it syncs the device: log sparingly)
    logit_scale: torch.Tensor
    stats: StepStats


def contrastive_loss(loss_fn: nn.Module, out: dict[str, torch.Tensor]) -> torch.Tensor:
    return loss_fn(out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"))


def train_step(
    engine: Engine,
    loss_fn: nn.Module,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float,
) -> StepOutput:
    """Forward, backward and optimizer step over one or more micro-batches of (images, texts)."""
    if len(micro_batches) == 1:
        out = engine.forward(*micro_batches[0])
        loss = contrastive_loss(loss_fn, out)
        engine.backward(loss)
    else:
        out, loss = _accumulate(engine, loss_fn, micro_batches)
    stats = engine.step(lr=lr)
    return StepOutput(loss=loss.detach(), logit_scale=out["logit_scale"].detach(), stats=stats)


def _accumulate(
    engine: Engine, loss_fn: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    rng_states, cached = [], []
    with torch.no_grad():
        for images, texts in micro_batches:
            rng_states.append(_rng_state(images.device))
            cached.append(engine.forward(images, texts))
    last = len(micro_batches) - 1
    for j, (images, texts) in enumerate(micro_batches):
        _set_rng_state(rng_states[j], images.device)
        with contextlib.nullcontext() if j == last else engine.no_sync():
            out = engine.forward(images, texts)
            merged = {
                k: torch.cat([out[k] if i == j else c[k] for i, c in enumerate(cached)]) for k in FEATURES
            }
            for k in ("logit_scale", "logit_bias"):
                if k in out:
                    merged[k] = out[k] if j == last else out[k].detach()
            loss = contrastive_loss(loss_fn, merged)
            engine.backward(loss)
    return out, loss


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def verify_inputs(loss_fn: nn.Module, *, step: int) -> None:
    """Collective: raise the loss's deferred input errors (non-finite features, logit scale or
    bias on any rank since the last call). One host read: call it where the loop reads the device
    anyway (log steps) and before a checkpoint is written, never every step."""
    verify = getattr(loss_fn, "verify", None)
    if verify is None:
        return
    try:
        verify()
    except NonFiniteLossError as e:
        raise NonFiniteLossError(f"by step {step}: {e}") from e


def log_step(
    run: Run, out: StepOutput, timer: StepTimer, loss_avg: Average, lr: float, loader: TrainLoader,
    console: bool = True,
) -> None:  # fmt: skip
    """Every --log-metric-every-n-steps: OpenCLIP's `train/` scalars, then bigclip's own, to the
    metric sinks; with `console` (--log-every-n-steps), OpenCLIP's log line too, with the loader's
    capacity, TFLOP/s per GPU, MFU and the ETA appended. Collective (every rank calls it on the same
    steps): the loss written is the global batch's."""
    state = run.progress.state
    steps_per_epoch = loader.steps_per_epoch // run.cfg.optim.accum_freq  # this epoch's loader's plan
    capacity = loader.stats.take_capacity()  # since the last log step
    verify_inputs(run.loss_fn, step=state.step)  # before anything is logged as a finite loss
    loss = out.loss.clone()
    # The slowest rank's data-loader capacity (samples/s its workers could deliver) sets the pace.
    capacity_t = torch.tensor([capacity], dtype=torch.float64)
    if run.runtime.world_size > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the global loss; every rank logs on the same steps
        dist.all_reduce(capacity_t, op=dist.ReduceOp.MIN, group=cpu_group())
    capacity = float(capacity_t)
    loss_value = run.progress.last_loss = loss.item()
    loss_avg.add(loss_value)
    scale = out.logit_scale.item()
    samples_per_s = run.global_batch / max(timer.batch.avg, 1e-9)
    pace = throughput.measure(
        flops_per_sample=throughput.train_flops_per_sample(run.cfg), samples_per_s=samples_per_s,
        world_size=run.runtime.world_size, peak_tflops=throughput.device_peak_tflops(run.runtime.device),
        steps_left=run.progress.total_steps - state.step, step_s=timer.batch.avg,
    )  # fmt: skip
    if console:
        get_logger().info(
            train_log_line(epoch=state.epoch, samples_done=state.epoch_step * run.global_batch,
                           samples_per_epoch=steps_per_epoch * run.global_batch, timer=timer,
                           global_batch=run.global_batch, world_size=run.runtime.world_size, lr=lr,
                           logit_scale=scale, loss=loss_value, loss_avg=loss_avg.avg)
            + f" Loader capacity: {capacity:#g}/s/gpu"  # Data (t) above is the wait for data
            + throughput.log_fields(pace)
        )  # fmt: skip
    openclip = {  # open_clip_train/train.py's names: dashboards built on OpenCLIP runs read these
        "train/data_time": timer.data.avg,
        "train/batch_time": timer.batch.avg,
        "train/samples_per_second": samples_per_s,
        "train/samples_per_second_per_gpu": samples_per_s / run.runtime.world_size,
        "train/scale": scale,  # the logit scale, exponentiated
        "train/lr": lr,
        f"train/{LOSS_NAME}": loss_value,  # each loss term by name (bigclip has one)...
        "train/loss": loss_value,  # ...and their sum
    }
    own = {
        "train/grad_norm": out.stats.grad_norm.item(),
        "train/data_capacity_per_gpu": capacity,  # < samples_per_second_per_gpu: data-bound
        "train/peak_memory_gb": peak_memory_gb(run.runtime.device),
    }
    run.scalars.scalars(openclip | own | throughput.scalars(pace), step=state.step)
    timer.reset()


# --- Saving and stopping --------------------------------------------------------------------------


def wait_for_upload(run: Run) -> None:
    """Block until the save in flight is committed; says so if that takes long."""
    with phase("waiting for the checkpoint upload to commit", announce=False, quiet_s=QUIET_S):
        run.checkpointer.wait()


def stop_at_epoch_end(run: Run, loader: TrainLoader) -> None:
    """An epoch's end is a step boundary too: a stop request that came during its evaluation or
    save is honoured now (collective; the Checkpointer's per-step decision, at the next epoch's start)."""
    signum = run.checkpointer.maybe_save(run.progress.state, data_position=lambda: None)
    if signum:
        stop_for_requeue(run, loader, signum)


def stop_for_requeue(run: Run, loader: TrainLoader, signum: int) -> None:
    """After the checkpoint of a stop request (SIGUSR1/SIGTERM/SIGINT on any rank): wait for its
    upload, leave the requeue marker, stop."""
    step = run.progress.state.step
    wait_for_upload(run)
    announce_requeue(run.run_dir, step=step, signum=signum, is_main=run.runtime.is_main)
    loader.close()
    close_run(run, strict=False)  # exit 85 regardless: the requeued job resumes from what is there
    raise Preempted(step, signum)


def stop_after_failed_save(run: Run, error: SaveFailed) -> None:
    """The stop request's or the end's checkpoint failed (every rank knows): leave the requeue
    marker, so the job comes back and resumes from the latest committed checkpoint, and stop."""
    if run.runtime.is_main:
        get_logger().error(f"{error}; exiting with {REQUEUE_EXIT_CODE} so the job is requeued and resumes "
                           "from the latest committed checkpoint")  # fmt: skip
    announce_requeue(run.run_dir, step=error.step, signum=run.guards.preemption.signum, is_main=run.runtime.is_main,
                     reason="checkpoint failed")  # fmt: skip
    close_run(run, strict=False)


def close_run(run: Run, *, strict: bool = True) -> None:
    """Release what the run holds; the final backup is waited for (`strict`: raise if incomplete)."""
    run.guards.watchdog.close()  # no steps from here on
    run.scalars.close()  # flushed before the final sync copies the logs
    try:
        run.checkpointer.close(strict=strict)  # the upload in flight, then the final sync
    finally:
        run.guards.close()


# --- The door -------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Set up, fit (or, with no --train-data, evaluate) and close a run of a checked config; its
    summary. A failed stop or end checkpoint leaves the requeue marker before SaveFailed leaves."""
    run = setup(cfg)
    try:
        return evaluate_only(run) if cfg.evaluates_only else fit(run)
    except SaveFailed as e:
        stop_after_failed_save(run, e)
        raise
    except RuntimeError as e:  # a collective failed (a peer died, a timeout): say which ranks are gone
        if run.runtime.world_size > 1:
            run.guards.watchdog.explain_failure(e)
        raise


def main(cfg: TrainConfig) -> int:
    """Train a checked config (entry.py); the exit code (85: requeue me)."""
    try:
        summary = train(cfg)
    except Preempted as e:
        get_logger().info(f"{e}; exiting with {REQUEUE_EXIT_CODE} so the job is requeued")
        return REQUEUE_EXIT_CODE
    except SaveFailed:
        return REQUEUE_EXIT_CODE  # said, and the marker left, by train
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    get_logger().info(f"done: {summary}")
    return 0
