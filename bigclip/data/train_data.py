"""A run's training data: shards validated once, data workers started once, one loader per epoch.

    data = TrainData(cfg.data, rank=r, world_size=n, seed=s, image_size=224, tokenizer=tok,
                     device=d, image_dtype=torch.bfloat16, shards=shards)
    for epoch in range(start_epoch, epochs):
        loader = data.epoch(epoch, position=saved if epoch == start_epoch else None)
        for batch in loader: ...          # a TrainLoader (loader.py)
    data.close()                          # stops the worker processes

Every epoch's loader runs on the same worker processes (pool.py): each worker builds its storage
client once for the run (on S3: one boto3 client, one credential look-up, storage/s3_credentials.py)
instead of once per epoch, and no epoch start forks. Only one loader of a `TrainData` iterates at
a time: the next epoch's takes the workers over from the previous one.
"""

from __future__ import annotations

from typing import Any

import torch

from bigclip.config import DataConfig
from bigclip.data.loader import TrainLoader
from bigclip.data.open_schedule import OPEN_RATE
from bigclip.data.pool import ReaderPool
from bigclip.data.shards import ShardList
from bigclip.data.tokenizer import Tokenizer
from bigclip.data.validation import validate_data


class TrainData:
    def __init__(
        self,
        cfg: DataConfig,
        *,
        rank: int,
        world_size: int,
        seed: int,
        image_size: int,
        tokenizer: Tokenizer,
        device: torch.device | str | None = None,
        image_dtype: torch.dtype = torch.float32,
        normalize: bool = True,
        shards: ShardList | None = None,
        open_rate: float | None = OPEN_RATE,
    ) -> None:
        self.cfg = cfg
        self.shards = shards or validate_data(cfg, world_size=world_size)
        self._options: dict[str, Any] = dict(
            rank=rank, world_size=world_size, seed=seed, image_size=image_size, tokenizer=tokenizer,
            device=device, image_dtype=image_dtype, normalize=normalize, open_rate=open_rate,
        )  # fmt: skip
        pin = device is not None and torch.device(device).type == "cuda"
        self.pool = ReaderPool.for_config(
            cfg, self.shards, image_size=image_size, tokenizer=tokenizer, pin_memory=pin
        )

    def epoch(self, epoch: int, *, position: dict[str, Any] | None = None) -> TrainLoader:
        """The loader of `epoch` (from `position` within it, a saved state, when given), on the run's workers."""
        return TrainLoader(self.cfg, epoch=epoch, position=position, shards=self.shards, pool=self.pool,
                           **self._options)  # fmt: skip

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids (empty before the first epoch starts, and with --workers 0)."""
        return self.pool.worker_pids

    def close(self) -> None:
        """Stop the worker processes."""
        self.pool.close()

    def __enter__(self) -> TrainData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
