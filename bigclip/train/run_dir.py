"""A run's name, its folder under --logs, the resolved config beside it, and its log files."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import torch.distributed as dist
import yaml

from bigclip.config import LogConfig, TrainConfig
from bigclip.distributed import Runtime
from bigclip.train.metrics import log_file_name, setup_logging


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
    """logs/NAME (rank 0 creates it); `write_config` fills it once the run may start."""
    cfg.log.name = run_name(cfg, runtime)
    run_dir = Path(cfg.log.logs) / cfg.log.name
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def write_config(cfg: TrainConfig, run_dir: Path, runtime: Runtime) -> None:
    """The resolved config beside the logs (rank 0), written after the checks that may refuse the
    run, so a refused run leaves an earlier run's config.yaml as it was."""
    if runtime.is_main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def start_logging(log: LogConfig, run_dir: Path, runtime: Runtime) -> logging.Logger:
    """The run's logger: out.log on rank 0; with --log-local, out-RANK.log on each node's local rank 0 too."""
    name = log_file_name(rank=runtime.rank, local_rank=runtime.local_rank, log_local=log.log_local)
    return setup_logging(rank=runtime.rank, log_file=run_dir / name if name else None,
                         local_rank=runtime.local_rank, log_local=log.log_local, debug=log.debug)  # fmt: skip
