"""Everything a run does once before its first step: its name, directory, log file, device, seeds."""

from __future__ import annotations

import datetime
import logging
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from bigclip.config import EngineConfig, LogConfig, TrainConfig
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


def seed_everything(seed: int, rank: int) -> None:
    """Different streams per rank (patch dropout, augmentation), as OpenCLIP's random_seed()."""
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)
    random.seed(seed + rank)


def start_logging(log: LogConfig, run_dir: Path, runtime: Runtime) -> logging.Logger:
    """The run's logger: out.log on rank 0; with --log-local, out-RANK.log on each node's local rank 0 too."""
    name = log_file_name(rank=runtime.rank, local_rank=runtime.local_rank, log_local=log.log_local)
    return setup_logging(rank=runtime.rank, log_file=run_dir / name if name else None,
                         local_rank=runtime.local_rank, log_local=log.log_local, debug=log.debug)  # fmt: skip


def requested_device(engine: EngineConfig) -> str:
    """--device, else with --no-set-device-rank the first visible GPU (OpenCLIP: cuda:0, for one
    GPU per process), else '' (cuda:LOCAL_RANK, or the CPU)."""
    if engine.device or engine.set_device_rank or not torch.cuda.is_available():
        return engine.device
    return "cuda:0"
