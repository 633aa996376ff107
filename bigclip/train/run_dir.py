"""A run's name, its folder under --logs, the resolved config beside it, and its log files.

Nothing is written before the run may start: `start_logging` logs to stdout and holds the file's
lines in memory; `open_run_dir`, called once every check has passed, makes the folder, writes
config.yaml and out.log (the held lines first). So a refused run leaves no folder behind, and an
earlier run's folder of the same --name stays as it was.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import torch.distributed as dist
import yaml

from bigclip.config import LogConfig, TrainConfig
from bigclip.distributed import Runtime
from bigclip.train.metrics import get_logger, log_file_name, setup_logging


class _HeldLines(logging.Handler):
    """The log file's lines until the run folder exists (a handful: the set-up's messages)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run_name(cfg: TrainConfig, runtime: Runtime) -> str:
    """OpenCLIP's default name (date-model-lr-batch-workers-precision), agreed on by all ranks."""
    if cfg.log.name:
        return cfg.log.name
    date = datetime.datetime.now().strftime("%Y_%m_%d-%H_%M_%S")
    name = "-".join(
        [
            date,
            f"model_{cfg.model.model.replace('/', '-')}",
            f"lr_{cfg.optim.lr}",
            f"b_{cfg.data.batch_size}",
            f"j_{cfg.data.workers}",
            f"p_{cfg.engine.precision}",
        ]
    )
    if runtime.world_size > 1:
        box = [name]
        dist.broadcast_object_list(box, src=0)  # ranks may straddle a second boundary
        name = box[0]
    return name


def prepare_run_dir(cfg: TrainConfig, runtime: Runtime) -> Path:
    """logs/NAME, named but not made: `open_run_dir` makes it once the run may start."""
    cfg.log.name = run_name(cfg, runtime)
    return Path(cfg.log.logs) / cfg.log.name


def start_logging(log: LogConfig, run_dir: Path, runtime: Runtime) -> logging.Logger:
    """The run's logger, on stdout; out.log on rank 0 (with --log-local, out-RANK.log on each node's
    local rank 0 too) receives its lines when `open_run_dir` opens it."""
    logger = setup_logging(rank=runtime.rank, local_rank=runtime.local_rank, log_local=log.log_local,
                           debug=log.debug)  # fmt: skip
    name = log_file_name(rank=runtime.rank, local_rank=runtime.local_rank, log_local=log.log_local)
    if name:  # a rank that logs to a file
        logger.addHandler(_HeldLines(run_dir / name))
    return logger


def open_run_dir(cfg: TrainConfig, run_dir: Path, runtime: Runtime) -> None:
    """Once every check has passed: the folder, the resolved config (rank 0) and the log file with
    the lines held so far."""
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # An evaluation may run in a training run's folder: it leaves that run's config.yaml as it is.
        config = "eval-config.yaml" if cfg.evaluates_only else "config.yaml"
        (run_dir / config).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    logger = get_logger()
    for held in [h for h in logger.handlers if isinstance(h, _HeldLines)]:
        held.path.parent.mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(held.path)
        file.setFormatter(logger.handlers[0].formatter)
        logger.removeHandler(held)
        logger.addHandler(file)
        for record in held.records:
            file.handle(record)
