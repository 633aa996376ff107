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
from bigclip.errors import NonFiniteLossError
from bigclip.train.checkpointer import SaveFailed
from bigclip.train.evaluate import held_out_retrieval, val_due
from bigclip.train.metrics import (
    Average,
    StepTimer,
    get_logger,
)
from bigclip.train.preemption import REQUEUE_EXIT_CODE, Preempted, announce_requeue
from bigclip.train.resume import at_epoch_start
from bigclip.train.run import Run, between_steps
from bigclip.train.schedule import lr_at
from bigclip.train.setup import setup
from bigclip.train.step import train_step
from bigclip.train.step_log import log_step


@between_steps
def build_loader(run: Run) -> data.TrainLoader:
    # Data workers are forked, and s3torchconnector tears its clients down before a fork:
    # an upload in flight must finish first.
    run.checkpointer.wait()
    return data.build_train_loader(
        run.cfg.data, rank=run.runtime.rank, world_size=run.runtime.world_size, seed=run.cfg.optim.seed,
        epoch=run.progress.state.epoch, image_size=run.engine.unwrapped().image_size, tokenizer=run.tokenizer,
        position=run.progress.data_position, device=run.runtime.device, image_dtype=run.engine.image_dtype,
        shards=run.shards,
    )  # fmt: skip


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
        signum = run.checkpointer.maybe_save(state, data_position=loader.state_dict)
        if signum:
            stop_for_requeue(run, loader, signum)
    return True


def stop_for_requeue(run: Run, loader: data.TrainLoader, signum: int) -> None:
    """After the checkpoint of a stop request (SIGUSR1/SIGTERM on any rank): wait for its upload,
    leave the requeue marker, stop."""
    step = run.progress.state.step
    run.checkpointer.wait()
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


@between_steps
def evaluate(run: Run, *, retrieval: bool = True, final: bool = False) -> dict[str, float] | None:
    """Held-out retrieval (with `retrieval`, given --val-data) and zero-shot classification (when due)."""
    cfg = run.cfg.data
    normalize = data.image_normalizer(cfg, device=run.runtime.device, dtype=run.engine.image_dtype)
    metrics: dict[str, float] = {}
    if retrieval and cfg.val_data and cfg.val_frequency:
        metrics = held_out_retrieval(run.engine, cfg, run.tokenizer, run.runtime, normalize=normalize)
    if run.zeroshot.due(run.progress.state.epoch, final=final):
        run.checkpointer.wait()  # its loader forks workers (see build_loader)
        metrics |= run.zeroshot.evaluate(run.engine, run.tokenizer, run.runtime, normalize=normalize,
                                         batch_size=cfg.batch_size, workers=cfg.workers)  # fmt: skip
    if not metrics:
        return None
    state = run.progress.state
    metrics["epoch"], metrics["step"] = state.epoch, state.step
    if run.runtime.is_main:
        get_logger().info("Eval: " + "  ".join(f"{k}: {v:.4g}" for k, v in metrics.items()))
        run.scalars.scalars({f"val/{k}": v for k, v in metrics.items()}, step=state.step)
        with open(run.run_dir / "results.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
    return metrics


def fit(run: Run) -> dict[str, Any]:
    cfg, progress, state = run.cfg, run.progress, run.progress.state
    loader = build_loader(run)
    steps_per_epoch = max(1, loader.steps_per_epoch // cfg.optim.accum_freq)  # planned: sets the LR schedule
    progress.total_steps = cfg.optim.max_steps or steps_per_epoch * cfg.optim.epochs
    progress.steps_per_epoch = steps_per_epoch
    if progress.step_from_epoch:  # an OpenCLIP checkpoint: its epoch, at this run's steps per epoch
        at_epoch_start(state, steps_per_epoch=steps_per_epoch, global_batch=run.global_batch)
        progress.step_from_epoch = False
    metrics = None
    while state.step < progress.total_steps and state.epoch < cfg.optim.epochs:
        run.engine.train()
        if not train_one_epoch(run, loader):
            break  # step budget spent mid-epoch
        loader.account_epoch()  # collective: rank 0 logs what the epoch read against its plan, and what it lost
        loader.close()
        state.epoch, state.epoch_step, progress.data_position = state.epoch + 1, 0, None
        final = state.step >= progress.total_steps or state.epoch >= cfg.optim.epochs
        metrics = evaluate(run, retrieval=val_due(cfg, state.epoch), final=final) or metrics
        run.checkpointer.save_at_epoch_end(state)
        if state.step < progress.total_steps and state.epoch < cfg.optim.epochs:
            loader = build_loader(run)
    return finish(run, loader, metrics)


def finish(run: Run, loader: data.TrainLoader, metrics: dict | None) -> dict[str, Any]:
    state = run.progress.state
    run.guards.watchdog.close()  # no steps from here on (the last upload may take long)
    run.checkpointer.save_at_end(state, data_position=loader.state_dict)
    loader.close()
    if metrics is None or metrics["step"] != state.step:
        metrics = evaluate(run, final=True) or metrics  # the final weights get evaluated too
    run.checkpointer.wait()  # the last upload must be committed before the run reports success
    latest = run.checkpointer.latest()
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


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    return fit(setup(cfg))


def main(cfg: TrainConfig) -> int:
    """Train a parsed config (entry.py parses and checks the flags first)."""
    run = None
    try:
        run = setup(cfg)
        summary = fit(run)
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
