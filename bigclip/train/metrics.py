"""Logging for the training loop: one logger that prints on rank 0, OpenCLIP's log line,
and TensorBoard scalars.

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

import torch

LOGGER_NAME = "bigclip"


def setup_logging(*, rank: int, log_file: Path | None = None) -> logging.Logger:
    """Rank 0 logs INFO to stdout (and the run's out.log); other ranks only warnings and errors."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s | %(levelname)s | %(message)s", datefmt="%Y-%m-%d,%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file is not None and rank == 0:
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
    last: float = 0.0

    def add(self, value: float) -> None:
        self.total, self.count, self.last = self.total + value, self.count + 1, value

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
    """Scalars for TensorBoard on rank 0; a no-op elsewhere or when disabled."""

    def __init__(self, log_dir: Path | None) -> None:
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict[str, float], *, step: int) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


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
    """OpenCLIP's training log line, field for field."""
    digits = len(str(samples_per_epoch))
    percent = 100.0 * samples_done / max(samples_per_epoch, 1)
    per_second = global_batch / max(timer.batch.avg, 1e-9)
    return (
        f"Train Epoch: {epoch} [{samples_done:>{digits}}/{samples_per_epoch} ({percent:.0f}%)] "
        f"Data (t): {timer.data.avg:.3f} Batch (t): {timer.batch.avg:.3f}, "
        f"{per_second:#g}/s, {per_second / world_size:#g}/s/gpu "
        f"LR: {lr:5f} Logit Scale: {logit_scale:.3f} Contrastive_loss: {loss:#.5g} ({loss_avg:#.5g})"
    )
