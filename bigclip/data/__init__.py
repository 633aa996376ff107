"""Training and evaluation data: webdataset shards from disk or S3, decoded, transformed,
tokenized and batched by workers, with an exact, world-size-free position (resume/).
May import storage, config, distributed and errors.

    shards = validate_data(cfg.data, world_size=n)   # before building the model: DataError in seconds
    tokenizer = build_tokenizer(cfg.data.tokenizer, context_length=L, vocab_size=V)
    data = TrainData(cfg.data, rank=r, world_size=n, seed=s, image_size=S, tokenizer=tokenizer,
                     shards=shards)       # the run's data workers, started once
    loader = data.epoch(e, position=saved)   # a TrainLoader; build_train_loader(...) for one alone
    for batch in loader: ...            # TrainBatch(images, texts, keys)
    mine = loader.rank_state()           # no collective; each rank saves its own (loader.py: the contract)
    same = continues_alone(mine, world_size=n, workers=w, batch_size=b, interleave=i, seed=s)
    position = mine if same else merge_rank_states(every_ranks_state)   # the latter: any world size
    held_out = load_eval_set(cfg.data.val_data, image_size=S, tokenizer=tokenizer)  # uint8 images
    normalize = image_normalizer(cfg.data, device=d, dtype=engine.image_dtype)  # uint8 -> model input

Module map: shards (patterns, existence, sizes, upsampling weights) -> streams (local / S3
bytes) -> tar_samples (samples + cursors) -> decode -> worker (read, transform to uint8, batch;
run by pool: persistent workers handed each epoch's jobs, their first opens spread by
open_schedule) -> batching + loader (consumer side: worker order, re-batching, epoch end;
accounting: what each epoch read against its plan and what it lost; train_data: a run's loaders
on one pool) -> device (normalisation on the GPU); validation checks all of it before a model is
built. resume/ holds who reads what (assignment), what has been consumed (position), how to
continue the same stream (reader_state, stream_state, randomness) and each rank's own share of
it (rank_state). transforms (+ augment: --aug-cfg), eval, tokenizer and index (`bigclip
index-shards`) stand alone.

The names below load on first use (PEP 562), so `bigclip index-shards` and the flag checks can
import a module of this package (shards, index) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "Augmentation": "augment",
    "DataStats": "accounting",
    "EpochAccount": "accounting",
    "EvalSample": "eval",
    "EvalSet": "eval",
    "HashingTokenizer": "tokenizer",
    "ImageNormalizer": "device",
    "SampleKeys": "decode",
    "ShardList": "shards",
    "Tokenizer": "tokenizer",
    "TrainBatch": "loader",
    "TrainData": "train_data",
    "TrainLoader": "loader",
    "build_tokenizer": "tokenizer",
    "build_train_loader": "loader",
    "continues_alone": "resume.rank_state",
    "eval_transform": "transforms",
    "expand_pattern": "shards",
    "image_normalizer": "device",
    "iter_eval_samples": "eval",
    "is_rank_state": "resume.rank_state",
    "load_eval_set": "eval",
    "merge_rank_states": "resume.rank_state",
    "train_transform": "transforms",
    "validate_data": "validation",
    "validate_shards": "shards",
}
__all__ = [
    "Augmentation",
    "DataStats",
    "EpochAccount",
    "EvalSample",
    "EvalSet",
    "HashingTokenizer",
    "ImageNormalizer",
    "SampleKeys",
    "ShardList",
    "Tokenizer",
    "TrainBatch",
    "TrainData",
    "TrainLoader",
    "build_tokenizer",
    "build_train_loader",
    "continues_alone",
    "eval_transform",
    "expand_pattern",
    "image_normalizer",
    "iter_eval_samples",
    "is_rank_state",
    "load_eval_set",
    "merge_rank_states",
    "train_transform",
    "validate_data",
    "validate_shards",
]

if TYPE_CHECKING:
    from bigclip.data.accounting import DataStats, EpochAccount
    from bigclip.data.augment import Augmentation
    from bigclip.data.decode import SampleKeys
    from bigclip.data.device import ImageNormalizer, image_normalizer
    from bigclip.data.eval import EvalSample, EvalSet, iter_eval_samples, load_eval_set
    from bigclip.data.loader import TrainBatch, TrainLoader, build_train_loader
    from bigclip.data.resume.rank_state import continues_alone, is_rank_state, merge_rank_states
    from bigclip.data.shards import ShardList, expand_pattern, validate_shards
    from bigclip.data.tokenizer import HashingTokenizer, Tokenizer, build_tokenizer
    from bigclip.data.train_data import TrainData
    from bigclip.data.transforms import eval_transform, train_transform
    from bigclip.data.validation import validate_data


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'bigclip.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bigclip.data.{_WHERE[name]}"), name)
