"""Every data error that can be found before a model is built: shards (train and val) and epoch size."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from bigclip.config import DataConfig
from bigclip.data.augment import Augmentation
from bigclip.data.device import image_normalizer
from bigclip.data.shards import ShardList, validate_shards
from bigclip.distributed import cpu_group
from bigclip.errors import DataError
from bigclip.storage.s3 import S3Settings


def epoch_samples(cfg: DataConfig, shards: ShardList) -> int:
    if cfg.train_num_samples:
        return cfg.train_num_samples
    if shards.total_samples is not None:
        return shards.total_samples
    raise DataError(
        f"cannot tell how many samples {cfg.train_data!r} holds: pass --train-num-samples N, or put a "
        'sizes.json ({"00000.tar": count, ...}) beside the shards'
    )


def validate_data(cfg: DataConfig, *, world_size: int, s3: S3Settings | None = None) -> ShardList:
    """Every data error that can be found before a model is built: shards (train and val) and epoch size.

    Returns the training shards, to pass to `build_train_loader(shards=...)` so they are listed once.
    Under torch.distributed this is collective: rank 0 lists and broadcasts the result (or its
    error), so 1024 ranks cost one listing of the bucket, not 1024 bursts that S3 would throttle.
    """
    group = cpu_group()
    if group is None or dist.get_world_size(group) == 1:
        return _validate_data_here(cfg, world_size=world_size, s3=s3)
    result: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            result[0] = _validate_data_here(cfg, world_size=world_size, s3=s3)
        except Exception as e:  # sent to every rank, so all of them stop with the same message
            result[0] = (
                e if isinstance(e, DataError) else DataError(f"rank 0 could not check the data: {e!r}")
            )
    dist.broadcast_object_list(result, src=0, group=group)
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def _validate_data_here(cfg: DataConfig, *, world_size: int, s3: S3Settings | None) -> ShardList:
    Augmentation.from_cfg(cfg.aug_cfg)  # ConfigErrors for --aug-cfg, --image-mean/std in seconds
    image_normalizer(cfg)
    shards = validate_shards(cfg.train_data, s3=s3).with_weights(cfg.train_data_upsampling_factors)
    if cfg.val_data:
        validate_shards(cfg.val_data, s3=s3, what="--val-data")
    samples = epoch_samples(cfg, shards)
    if samples < cfg.batch_size * world_size:
        raise DataError(
            f"an epoch of {samples} samples is less than one global batch "
            f"(--batch-size {cfg.batch_size} x {world_size} ranks); lower --batch-size or add data"
        )
    return shards
