"""Every data error that can be found before a model is built: shards (train and val) and epoch size.

What sizes.json settles is settled here, on rank 0, before any data is read: an epoch budget
(`--train-num-samples`) above the samples it lists is refused (without --dataset-resampled,
an epoch cannot read a sample twice), shards it lists as empty are counted and named, data it
lists no sample of is refused. Without sizes for every shard, the epoch cannot be balanced
(resume/assignment.py): a warning says so, and what each epoch then misses is logged at its
end (accounting.py).
"""

from __future__ import annotations

import logging

from bigclip.config import DataConfig
from bigclip.data.augment import Augmentation
from bigclip.data.decode import SampleKeys
from bigclip.data.device import image_normalizer
from bigclip.data.shards import ShardList, validate_shards
from bigclip.data.tar_samples import first_samples
from bigclip.distributed import on_rank0
from bigclip.errors import DataError

log = logging.getLogger("bigclip.data")
NAMED = 5


def epoch_samples(cfg: DataConfig, shards: ShardList) -> int:
    if cfg.train_num_samples:
        return cfg.train_num_samples
    if shards.total_samples is not None:
        return shards.total_samples
    unlisted = [url for url, size in zip(shards.urls, shards.sizes) if size is None]
    listed = len(shards.urls) - len(unlisted)
    which = (
        f"sizes.json lists {listed} of its {len(shards.urls)} shards"
        if listed
        else "no sizes.json lists its shards"
    )
    raise DataError(
        f"cannot tell how many samples {cfg.train_data!r} holds: {which} (not {unlisted[0]}); count them "
        f"with `bigclip index-shards '{cfg.train_data}'` (it writes sizes.json beside them), or pass "
        "--train-num-samples N"
    )


def validate_data(cfg: DataConfig, *, world_size: int, evaluation_only: bool = False) -> ShardList:
    """Every data error that can be found before a model is built: shards (train and val) and epoch size.

    Returns the training shards, to pass to `build_train_loader(shards=...)` so they are listed once
    (with `evaluation_only`, a run with no training data: none, the held-out shards checked).
    Under torch.distributed this is collective: rank 0 lists and broadcasts the result (or its
    error), so 1024 ranks cost one listing of the bucket, not 1024 bursts that S3 would throttle.
    """
    return on_rank0(
        lambda: _validate_data_here(cfg, world_size=world_size, evaluation_only=evaluation_only),
        failed=lambda e: (
            e if isinstance(e, DataError) else DataError(f"rank 0 could not check the data: {e!r}")
        ),
    )


def _validate_data_here(cfg: DataConfig, *, world_size: int, evaluation_only: bool = False) -> ShardList:
    Augmentation.from_cfg(cfg.aug_cfg)  # ConfigErrors for --aug-cfg, --image-mean/std in seconds
    image_normalizer(cfg)
    if evaluation_only:  # no --train-data (TrainConfig.evaluates_only): the held-out shards alone
        if cfg.val_data:
            validate_shards(cfg.val_data, what="--val-data")
        return ShardList(pattern="", urls=(), sizes=())
    keys = SampleKeys.parse(image_key=cfg.image_key, text_key=cfg.text_key)
    shards = validate_shards(cfg.train_data).with_weights(cfg.train_data_upsampling_factors)
    check_sample_keys(shards.urls[0], keys, what="--train-data")
    if shards.repeated and not cfg.dataset_resampled:  # OpenCLIP would read them twice: say it is not so
        log.warning("--train-data names %d shard(s) more than once; each is read once per epoch (to weight "
                    "sources, use --dataset-resampled with --train-data-upsampling-factors)", shards.repeated)  # fmt: skip
    if cfg.val_data:
        check_sample_keys(validate_shards(cfg.val_data, what="--val-data").urls[0], keys, what="--val-data")
    samples = epoch_samples(cfg, shards)
    check_sizes(cfg, shards)
    if samples < cfg.batch_size * world_size:
        raise DataError(
            f"an epoch of {samples} samples is less than one global batch "
            f"(--batch-size {cfg.batch_size} x {world_size} ranks); lower --batch-size or add data"
        )
    return shards


def check_sample_keys(url: str, keys: SampleKeys, *, what: str) -> None:
    """--image-key or --text-key that no sample has (mistyped, or shards of another layout) fails
    from the first shard's first samples, before the model is built: else every sample is skipped
    and the run fails only once an epoch's reading found nothing to train on. Several samples, so
    that one damaged sample is not taken for wrong keys (it is skipped and counted)."""
    samples = first_samples(url)
    for flag, wanted, what_for in (
        ("--image-key", keys.image, "image"),
        ("--text-key", keys.text, "caption"),
    ):
        if samples and not any(key in sample.files for sample in samples for key in wanted):
            holds = ", ".join(sorted({member for sample in samples for member in sample.files})) or "nothing"
            raise DataError(
                f"{what}: none of the first {len(samples)} samples of {url} has a member {flag} "
                f"{';'.join(wanted)!r} names (they hold {holds}); set {flag} to the suffix of the {what_for} members"
            )


def check_sizes(cfg: DataConfig, shards: ShardList) -> None:
    """Refuse what sizes.json rules out; count and name its empty shards; warn when it is incomplete."""
    total, pattern = shards.total_samples, cfg.train_data
    if total is None:
        listed = sum(size is not None for size in shards.sizes)
        if not cfg.dataset_resampled:
            log.warning(
                "sizes.json lists %d of the %d shards of --train-data: shards are dealt whole by estimate, so "
                "an epoch can end short of --train-num-samples %d (each epoch's shortfall is logged); run "
                "`bigclip index-shards %r` to read every sample once per epoch",
                listed, len(shards), cfg.train_num_samples, pattern,
            )  # fmt: skip
        return
    if total == 0:
        raise DataError(
            f"--train-data {pattern!r}: sizes.json lists no sample in its {len(shards)} shard(s) (all empty); "
            "point --train-data at shards with data, or recount with `bigclip index-shards PATTERN`"
        )
    empty = [u for u, size in zip(shards.urls, shards.sizes) if size == 0]
    if empty:
        more = f", +{len(empty) - NAMED} more" if len(empty) > NAMED else ""
        log.warning(
            "%d of the %d shards of --train-data are empty (sizes.json): %s%s",
            len(empty), len(shards), ", ".join(empty[:NAMED]), more,
        )  # fmt: skip
    if cfg.train_num_samples > total and not cfg.dataset_resampled:
        raise DataError(
            f"--train-num-samples {cfg.train_num_samples} is more than the {total} samples that sizes.json lists "
            f"for --train-data ({len(shards)} shards): an epoch reads each sample once, so lower it to at most "
            f"{total} (or leave it out), add --dataset-resampled to draw with replacement, or recount with "
            "`bigclip index-shards PATTERN` if shards were added"
        )
