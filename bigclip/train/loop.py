"""The training loop: build -> resume -> loop -> log -> evaluate -> checkpoint.

    python -m bigclip.train --model ViT-B-32 --train-data '/data/{00000..00999}.tar' ...
    torchrun --nproc-per-node 8 -m bigclip.train -- --model ViT-B-32 ...   (`--` keeps torchrun
        from reading bigclip's --logs as its own --logs-specs)
    deepspeed --num_gpus 8 --module bigclip.train --engine deepspeed --deepspeed-config ds_configs/zero3.json ...

Nothing here depends on which engine shards the model: the loop only calls the Engine verbs.
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from bigclip import data
from bigclip.config import TrainConfig
from bigclip.engines.compile import compile_activity
from bigclip.errors import NonFiniteLossError
from bigclip.train.checkpointer import SaveFailed
from bigclip.train.evaluate import evaluate, val_due
from bigclip.train.metrics import (
    Average,
    StepTimer,
    get_logger,
)
from bigclip.train.phases import QUIET_S, OnStop, begin, phase
from bigclip.train.preemption import REQUEUE_EXIT_CODE, Preempted, announce_requeue
from bigclip.train.resume import at_epoch_start
from bigclip.train.run import Run, between_steps
from bigclip.train.schedule import lr_at, resume_note, run_horizon, schedule_line, warmup_warning
from bigclip.train.setup import setup
from bigclip.train.step import train_step
from bigclip.train.step_log import log_step


def open_train_data(run: Run) -> data.TrainData:
    """The run's data workers, started once: every epoch's loader runs on them."""
    # They are forked when the first epoch starts, and s3torchconnector tears its clients down
    # before a fork: an upload in flight must finish first. Later epochs fork nothing.
    wait_for_upload(run)
    return data.TrainData(
        run.cfg.data, rank=run.runtime.rank, world_size=run.runtime.world_size, seed=run.cfg.optim.seed,
        image_size=run.engine.unwrapped().image_size, tokenizer=run.tokenizer, device=run.runtime.device,
        image_dtype=run.engine.image_dtype, shards=run.shards,
    )  # fmt: skip


@between_steps
def build_loader(run: Run, train_data: data.TrainData) -> data.TrainLoader:
    return train_data.epoch(run.progress.state.epoch, position=run.progress.data_position)


def wait_for_upload(run: Run) -> None:
    """Block until the save in flight is committed; says so if that takes long."""
    with phase("waiting for the checkpoint upload to commit", announce=False, quiet_s=QUIET_S):
        run.checkpointer.wait()


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


def train_one_epoch(run: Run, loader: data.TrainLoader) -> bool:
    """Train until the epoch's data ends (True) or the step budget does (False, unless at the epoch end)."""
    cfg, progress, state = run.cfg, run.progress, run.progress.state
    timer, loss_avg = StepTimer(), Average()
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
        console = state.step % cfg.log.log_every_n_steps == 0 or state.step == progress.total_steps
        if console or state.step % cfg.log.log_metric_every_n_steps == 0:  # as OpenCLIP main: both
            log_step(
                run, out, timer, loss_avg, lr, steps_per_epoch=loader.steps_per_epoch // cfg.optim.accum_freq,
                capacity=loader.stats.take_capacity(), console=console,
            )  # fmt: skip
        if state.step >= progress.total_steps:  # ending with the epoch, it completes it (evaluated, saved)
            return state.epoch_step >= progress.steps_per_epoch
        signum = run.checkpointer.maybe_save(state, data_position=loader.rank_state)
        if signum:
            stop_for_requeue(run, loader, signum)
    return True


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


def stop_at_epoch_end(run: Run, loader: data.TrainLoader) -> None:
    """An epoch's end is a step boundary too: a stop request that came during its evaluation or
    save is honoured now (collective; the Checkpointer's per-step decision, at the next epoch's start)."""
    signum = run.checkpointer.maybe_save(run.progress.state, data_position=lambda: None)
    if signum:
        stop_for_requeue(run, loader, signum)


def stop_for_requeue(run: Run, loader: data.TrainLoader, signum: int) -> None:
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


def fit(run: Run) -> dict[str, Any]:
    with open_train_data(run) as train_data:
        return fit_epochs(run, train_data)


def fit_epochs(run: Run, train_data: data.TrainData) -> dict[str, Any]:
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


def finish(run: Run, loader: data.TrainLoader, metrics: dict | None) -> dict[str, Any]:
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


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    run = setup(cfg)
    return evaluate_only(run) if cfg.evaluates_only else fit(run)


def main(cfg: TrainConfig) -> int:
    """Train a parsed config (entry.py parses and checks the flags first)."""
    run = None
    try:
        run = setup(cfg)
        summary = evaluate_only(run) if cfg.evaluates_only else fit(run)
    except Preempted as e:
        get_logger().info(f"{e}; exiting with {REQUEUE_EXIT_CODE} so the job is requeued")
        return REQUEUE_EXIT_CODE
    except SaveFailed as e:
        if run is not None:  # always: only a run's checkpointer raises it
            stop_after_failed_save(run, e)
        return REQUEUE_EXIT_CODE
    except RuntimeError as e:  # a collective failed (a peer died, a timeout): say which ranks are gone
        if run is not None and run.runtime.world_size > 1:
            run.guards.watchdog.explain_failure(e)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    get_logger().info(f"done: {summary}")
    return 0
