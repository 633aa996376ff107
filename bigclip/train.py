"""The training loop: build -> (resume) -> loop -> log -> evaluate -> checkpoint.

    python -m bigclip.train --model ViT-B-32 --train-data '/data/{00000..00999}.tar' ...
    torchrun --nproc-per-node 8 -m bigclip.train ...
    deepspeed --num_gpus 8 -m bigclip.train --engine deepspeed --deepspeed-config ds_configs/zero3.json ...

Nothing here depends on which engine shards the model: the loop only calls the Engine verbs.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bigclip import data
from bigclip.cli_args import parse_train_args
from bigclip.config import TrainConfig, lr_at
from bigclip.distributed import Runtime, init_distributed
from bigclip.engines import Engine, build_engine
from bigclip.errors import BigclipError, NonFiniteLossError
from bigclip.evaluate import evaluate_retrieval
from bigclip.metrics import (
    Average,
    StepTimer,
    TensorBoard,
    get_logger,
    peak_memory_gb,
    setup_logging,
    train_log_line,
)
from bigclip.models import get_model_config
from bigclip.ops.contrastive import build_loss
from bigclip.run_setup import build_model, prepare_run_dir, seed_everything
from bigclip.s3 import S3Settings
from bigclip.train_step import train_step


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    samples_seen: int = 0


@dataclass
class Run:
    """What the loop carries around."""

    cfg: TrainConfig
    runtime: Runtime
    run_dir: Path
    engine: Engine
    loss_fn: torch.nn.Module
    tokenizer: Any
    tensorboard: TensorBoard
    shards: data.ShardList
    s3: S3Settings
    state: TrainState = field(default_factory=TrainState)
    total_steps: int = 0
    last_loss: float | None = None  # the global loss at the latest log step

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.cfg.optim.accum_freq * self.runtime.world_size


def setup(cfg: TrainConfig) -> Run:
    """Validate inputs that can fail cheaply, then build the model and engine."""
    runtime = init_distributed(backend=cfg.engine.dist_backend, device=cfg.engine.device)
    run_dir = prepare_run_dir(cfg, runtime)
    log = setup_logging(rank=runtime.rank, log_file=run_dir / "out.log")
    seed_everything(cfg.optim.seed, runtime.rank)
    text_cfg = get_model_config(cfg.model.model).text_cfg
    tokenizer = data.build_tokenizer(
        cfg.data.tokenizer, context_length=text_cfg.context_length, vocab_size=text_cfg.vocab_size
    )
    s3 = S3Settings.resolve(endpoint=cfg.checkpoint.s3_endpoint, region=cfg.checkpoint.s3_region)
    shards = data.validate_data(cfg.data, world_size=runtime.world_size, s3=s3)  # DataError in seconds
    log.info(
        f"run {cfg.log.name}: {runtime.world_size} rank(s), engine {cfg.engine.engine}, model {cfg.model.model}"
    )
    engine = build_engine(cfg, runtime)
    engine.build(build_model(cfg))
    tensorboard = TensorBoard(run_dir / "tensorboard" if runtime.is_main and cfg.log.report_to else None)
    return Run(cfg, runtime, run_dir, engine, build_loss(cfg.loss), tokenizer, tensorboard, shards, s3)


def micro_batches(loader: Any, *, k: int, device: torch.device):
    """Group the loader's batches by k (the accumulation factor) and move them to the device."""
    group = []
    for batch in loader:
        group.append((batch.images.to(device, non_blocking=True), batch.texts.to(device, non_blocking=True)))
        if len(group) == k:
            yield group
            group = []


def train_one_epoch(run: Run, loader: Any) -> None:
    cfg, state = run.cfg, run.state
    timer, loss_avg = StepTimer(), Average()
    samples_per_epoch = loader.steps_per_epoch * cfg.data.batch_size * run.runtime.world_size
    start_samples = state.samples_seen
    for group in micro_batches(loader, k=cfg.optim.accum_freq, device=run.runtime.device):
        timer.data_ready()
        lr = lr_at(state.step, cfg.optim, run.total_steps)
        try:
            out = train_step(run.engine, run.loss_fn, group, lr=lr)
        except NonFiniteLossError as e:
            raise NonFiniteLossError(f"step {state.step}: {e}") from e
        state.step += 1
        state.samples_seen += run.global_batch
        timer.step_done()
        if state.step % cfg.log.log_every_n_steps == 0 or state.step == run.total_steps:
            _log_step(
                run,
                out,
                timer,
                loss_avg,
                lr,
                samples_done=state.samples_seen - start_samples,
                samples_per_epoch=samples_per_epoch,
            )
        if state.step >= run.total_steps:
            break


def _log_step(run: Run, out: Any, timer: StepTimer, loss_avg: Average, lr: float, **progress: int) -> None:
    loss = out.loss.clone()
    if run.runtime.world_size > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the global loss; every rank logs on the same steps
    loss_value = run.last_loss = loss.item()
    loss_avg.add(loss_value)
    scale = out.logit_scale.item()
    get_logger().info(
        train_log_line(
            epoch=run.state.epoch,
            timer=timer,
            global_batch=run.global_batch,
            world_size=run.runtime.world_size,
            lr=lr,
            logit_scale=scale,
            loss=loss_value,
            loss_avg=loss_avg.avg,
            **progress,
        )
    )
    run.tensorboard.scalars(
        {
            "train/loss": loss_value,
            "train/lr": lr,
            "train/logit_scale": scale,
            "train/grad_norm": out.stats.grad_norm.item(),
            "train/samples_per_second": run.global_batch / max(timer.batch.avg, 1e-9),
            "train/data_time": timer.data.avg,
            "train/batch_time": timer.batch.avg,
            "train/peak_memory_gb": peak_memory_gb(run.runtime.device),
        },
        step=run.state.step,
    )
    timer.reset()


def evaluate(run: Run) -> dict[str, float] | None:
    if not run.cfg.data.val_data:
        return None
    mine = data.iter_eval_samples(
        run.cfg.data.val_data,
        image_size=run.engine.unwrapped().image_size,
        tokenizer=run.tokenizer,
        limit=run.cfg.data.val_num_samples,
        rank=run.runtime.rank,
        world_size=run.runtime.world_size,
        s3=run.s3,
    )
    metrics = evaluate_retrieval(run.engine, list(mine), run.runtime, batch_size=run.cfg.data.batch_size)
    metrics["epoch"], metrics["step"] = run.state.epoch, run.state.step
    if run.runtime.is_main:
        get_logger().info("Eval: " + "  ".join(f"{k}: {v:.4g}" for k, v in metrics.items()))
        run.tensorboard.scalars({f"val/{k}": v for k, v in metrics.items()}, step=run.state.step)
        with open(run.run_dir / "results.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
    return metrics


def build_loader(run: Run, *, position: dict | None = None) -> data.TrainLoader:
    return data.build_train_loader(
        run.cfg.data,
        rank=run.runtime.rank,
        world_size=run.runtime.world_size,
        seed=run.cfg.optim.seed,
        epoch=run.state.epoch,
        image_size=run.engine.unwrapped().image_size,
        tokenizer=run.tokenizer,
        position=position,
        device=run.runtime.device,
        s3=run.s3,
        shards=run.shards,
    )


def fit(run: Run) -> dict[str, Any]:
    cfg, state = run.cfg, run.state
    loader = build_loader(run)
    steps_per_epoch = max(1, loader.steps_per_epoch // cfg.optim.accum_freq)  # planned: sets the LR schedule
    run.total_steps = cfg.optim.max_steps or steps_per_epoch * cfg.optim.epochs
    metrics = None
    while state.step < run.total_steps and state.epoch < cfg.optim.epochs:
        run.engine.train()
        train_one_epoch(run, loader)
        loader.close()
        state.epoch += 1
        metrics = evaluate(run)
        if state.step < run.total_steps and state.epoch < cfg.optim.epochs:
            loader = build_loader(run)
    run.tensorboard.close()
    return {
        "step": state.step,
        "epoch": state.epoch,
        "samples_seen": state.samples_seen,
        "loss": run.last_loss,
        "eval": metrics,
        "run_dir": str(run.run_dir),
    }


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    return fit(setup(cfg))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_train_args(argv)
    try:
        summary = run_training(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    get_logger().info(f"done: {summary}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BigclipError as e:
        print(f"bigclip: error: {e}", file=sys.stderr)
        sys.exit(2)
