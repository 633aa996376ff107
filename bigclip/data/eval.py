"""Held-out samples for retrieval evaluation, in one deterministic order.

Shards in pattern order, samples in tar order, corrupt ones skipped (the same ones on every
rank, so every rank agrees on the numbering). Each sample has an `index` in that order; with
`rank` / `world_size` only the samples with `index % world_size == rank` are transformed,
tokenized and yielded (every rank still decodes all images, to agree on which are corrupt).
Images are OpenCLIP's exact evaluation transform as uint8 [H, W, 3]; the caller normalises
them on its device (device.ImageNormalizer), as the training loader does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from bigclip.data.decode import DEFAULT_KEYS, Decoded, SampleKeys, decode_sample
from bigclip.data.shards import validate_shards
from bigclip.data.tar_samples import ShardSamples
from bigclip.data.tokenizer import Tokenizer
from bigclip.data.transforms import eval_transform


@dataclass
class EvalSample:
    index: int  # position in the held-out order (0, 1, ...), the same on every rank
    key: str
    caption: str
    image: torch.Tensor  # uint8 [H, W, 3], eval transform (normalise with device.ImageNormalizer)
    tokens: torch.Tensor  # long [context_length]


@dataclass
class EvalSet:
    """A rank's share of the held-out set as tensors (small sets: the demo's, a few thousand samples)."""

    indices: list[int]
    keys: list[str]
    captions: list[str]
    images: torch.Tensor  # uint8 [N, H, W, 3]
    texts: torch.Tensor  # [N, context_length]


def _decoded_samples(pattern: str, *, skipped: Counter, keys: SampleKeys) -> Iterator[Decoded]:
    shards = validate_shards(pattern, what="--val-data")
    for url in shards.urls:
        for raw in ShardSamples(url):
            decoded = decode_sample(raw, load=True, keys=keys)
            if isinstance(decoded, str):
                skipped[decoded] += 1
                continue
            yield decoded


def iter_eval_samples(
    pattern: str,
    *,
    image_size: int,
    tokenizer: Tokenizer,
    limit: int = 0,
    rank: int = 0,
    world_size: int = 1,
    skipped: Counter | None = None,
    resize_mode: str = "shortest",
    interpolation: str = "bicubic",
    keys: SampleKeys = DEFAULT_KEYS,
) -> Iterator[EvalSample]:
    """Samples `index % world_size == rank` among the first `limit` (0: all); skips counted in `skipped`."""
    transform = eval_transform(image_size, resize_mode=resize_mode, interpolation=interpolation)
    counts = skipped if skipped is not None else Counter()
    for index, decoded in enumerate(_decoded_samples(pattern, skipped=counts, keys=keys)):
        if limit and index >= limit:
            return
        if index % world_size != rank:
            continue
        yield EvalSample(
            index=index,
            key=decoded.key,
            caption=decoded.caption,
            image=torch.from_numpy(transform(decoded.image).copy()),  # PIL's pixels are read-only
            tokens=tokenizer([decoded.caption])[0],
        )


def load_eval_set(
    pattern: str,
    *,
    image_size: int,
    tokenizer: Tokenizer,
    limit: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> EvalSet:
    samples = list(
        iter_eval_samples(
            pattern,
            image_size=image_size,
            tokenizer=tokenizer,
            limit=limit,
            rank=rank,
            world_size=world_size,
        )
    )
    empty_images = torch.empty(0, image_size, image_size, 3, dtype=torch.uint8)
    return EvalSet(
        indices=[s.index for s in samples],
        keys=[s.key for s in samples],
        captions=[s.caption for s in samples],
        images=torch.stack([s.image for s in samples]) if samples else empty_images,
        texts=torch.stack([s.tokens for s in samples]) if samples else tokenizer([])[:0],
    )
