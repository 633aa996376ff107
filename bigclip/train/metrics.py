"""Logging for the training loop: one logger that prints on rank 0 (and, with --log-local,
on every node's local rank 0), OpenCLIP's log line, and scalars for TensorBoard and wandb
(`--report-to tensorboard,wandb`, written by rank 0 only).

Values are tensors until a log step: reading a device tensor (`.item()`) waits for the GPU,
so the loop only does it every `--log-every-n-steps`.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bigclip.config import LogConfig, TrainConfig
from bigclip.storage.redact import redact

LOGGER_NAME = "bigclip"
LOSS_NAME = "contrastive_loss"  # OpenCLIP's name for the CLIP and SigLIP loss term (loss.py, output_dict)


def log_file_name(*, rank: int, local_rank: int, log_local: bool) -> str | None:
    """OpenCLIP's choice: out.log on rank 0; with --log-local, out-RANK.log on each node's local rank 0."""
    if log_local and local_rank == 0:
        return f"out-{rank}.log"
    return "out.log" if rank == 0 else None


def setup_logging(
    *, rank: int, log_file: Path | None = None, local_rank: int = -1, log_local: bool = False,
    debug: bool = False,
) -> logging.Logger:  # fmt: skip
    """Rank 0 (with `log_local`, every node's local rank 0) logs INFO, or DEBUG with `debug`, to
    stdout and `log_file`; other ranks only warnings and errors, to stdout."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.propagate = False
    logs = rank == 0 or (log_local and local_rank == 0)
    logger.setLevel((logging.DEBUG if debug else logging.INFO) if logs else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s | %(levelname)s | %(message)s", datefmt="%Y-%m-%d,%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file is not None and logs:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


@dataclass
class Average:
    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total, self.count = self.total + value, self.count + 1

    @property
    def avg(self) -> float:
        return self.total / max(self.count, 1)


@dataclass
class StepTimer:
    """Data-wait and step times between log lines."""

    data: Average = field(default_factory=Average)
    batch: Average = field(default_factory=Average)
    _mark: float = field(default_factory=time.perf_counter)

    def data_ready(self) -> None:
        now = time.perf_counter()
        self.data.add(now - self._mark)

    def step_done(self) -> None:
        now = time.perf_counter()
        self.batch.add(now - self._mark)
        self._mark = now

    def reset(self) -> None:
        self.data, self.batch = Average(), Average()


class TensorBoard:
    """Scalars for TensorBoard (rank 0 only: Scalars.open makes no sink elsewhere)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict[str, float], *, step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class Wandb:
    """Scalars for Weights & Biases, as OpenCLIP's trainer sends them: run name and id are the run's
    --name (so a resumed run continues the same wandb run), the resolved config (credentials
    redacted), files under the run folder. `WANDB_MODE=offline` writes it all locally."""

    def __init__(self, log: LogConfig, *, config: dict[str, Any], run_dir: Path, resuming: bool) -> None:
        import wandb  # optional: checked when --report-to is parsed

        self.run = wandb.init(
            project=log.wandb_project_name, name=log.name, id=log.name, notes=log.wandb_notes or None,
            dir=str(run_dir), config=redact(config), resume="allow" if resuming else None,
        )  # fmt: skip

    def scalars(self, values: dict[str, float], *, step: int) -> None:
        self.run.log({**values, "step": step}, step=step)

    def close(self) -> None:
        self.run.finish()


class Scalars:
    """The run's metric sinks (`--report-to`), written together; none on ranks other than 0."""

    def __init__(self, sinks: list[TensorBoard | Wandb]) -> None:
        self.sinks = sinks

    @classmethod
    def open(cls, cfg: TrainConfig, *, run_dir: Path, is_main: bool) -> Scalars:
        names = cfg.log.sinks() if is_main else []
        sinks: list[TensorBoard | Wandb] = []
        if "tensorboard" in names:
            sinks.append(TensorBoard(run_dir / "tensorboard"))
        if "wandb" in names:
            resuming = bool(cfg.checkpoint.resume)
            sinks.append(Wandb(cfg.log, config=cfg.to_dict(), run_dir=run_dir, resuming=resuming))
        return cls(sinks)

    def scalars(self, values: dict[str, float], *, step: int) -> None:
        for sink in self.sinks:
            sink.scalars(values, step=step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def train_log_line(
    *,
    epoch: int,
    samples_done: int,
    samples_per_epoch: int,
    timer: StepTimer,
    global_batch: int,
    world_size: int,
    lr: float,
    logit_scale: float,
    loss: float,
    loss_avg: float,
) -> str:
    """OpenCLIP's training log line, field for field: each loss term by name, then the total
    (`Loss:`; bigclip has one term, the contrastive loss)."""
    digits = len(str(samples_per_epoch))
    percent = 100.0 * samples_done / max(samples_per_epoch, 1)
    per_second = global_batch / max(timer.batch.avg, 1e-9)
    return (
        f"Train Epoch: {epoch} [{samples_done:>{digits}}/{samples_per_epoch} ({percent:.0f}%)] "
        f"Data (t): {timer.data.avg:.3f} Batch (t): {timer.batch.avg:.3f}, "
        f"{per_second:#g}/s, {per_second / world_size:#g}/s/gpu "
        f"LR: {lr:5f} Logit Scale: {logit_scale:.3f} {LOSS_NAME.capitalize()}: {loss:#.5g} ({loss_avg:#.5g}) "
        f"Loss: {loss:#.5g} ({loss_avg:#.5g})"
    )
