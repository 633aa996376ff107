"""Helpers for the data tests: small webdataset shards with known keys (no tests here)."""

from __future__ import annotations

import gzip
import io
import json
import os
import random

from PIL import Image

from bigclip.config import DataConfig
from bigclip.data.tokenizer import HashingTokenizer
from bigclip.demo.shapes_data import tar_bytes

IMAGE_SIZE = 8
TOKENIZER = HashingTokenizer(context_length=16, vocab_size=1000)


def image_bytes(colour: tuple[int, int, int], fmt: str = "PNG", size: int = 12) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format=fmt)
    return out.getvalue()


def noise_image_bytes(rng: random.Random, size: int = 12) -> bytes:
    """Random pixels: unlike a plain colour, every crop of it looks different."""
    out = io.BytesIO()
    Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3)).save(out, format="PNG")
    return out.getvalue()


def good_sample(key: str, rng: random.Random, *, textured: bool = False) -> dict:
    colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
    image = noise_image_bytes(rng) if textured else image_bytes(colour)
    return {"__key__": key, "png": image, "txt": f"caption of {key}"}


def write_shard(path: str, samples: list[dict]) -> None:
    data = tar_bytes(samples)
    if path.endswith((".tar.gz", ".tgz")):
        data = gzip.compress(data)
    with open(path, "wb") as f:
        f.write(data)


def bad_sample(key: str) -> dict:
    return {"__key__": key, "jpg": b"\xff\xd8 truncated jpeg", "txt": f"caption of {key}"}


def write_dataset(
    root: str,
    sizes: list[int],
    *,
    seed: int = 0,
    compressed: tuple[int, ...] = (),
    bad_every: int = 0,
    textured: bool = False,
) -> str:
    """Shards root/NNNNN.tar (.tgz for indices in `compressed`), keys 'sSSSSiIIII', sizes.json; the pattern.

    With `bad_every`, every such sample (i % bad_every == bad_every - 1) has undecodable image bytes.
    With `textured`, images are random pixels, so that crops show in the image tensors.
    """
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    names = {}
    for shard, size in enumerate(sizes):
        name = f"{shard:05d}.tgz" if shard in compressed else f"{shard:05d}.tar"
        keys = [f"s{shard:04d}i{i:04d}" for i in range(size)]
        is_bad = [bool(bad_every) and i % bad_every == bad_every - 1 for i in range(size)]
        samples = [
            bad_sample(k) if bad else good_sample(k, rng, textured=textured) for k, bad in zip(keys, is_bad)
        ]
        write_shard(os.path.join(root, name), samples)
        names[name] = size
    with open(os.path.join(root, "sizes.json"), "w") as f:
        json.dump(names, f)
    return "::".join(os.path.join(root, n) for n in names)


def valid_keys(sizes: list[int], *, bad_every: int = 0) -> set[str]:
    return {
        f"s{shard:04d}i{i:04d}"
        for shard, size in enumerate(sizes)
        for i in range(size)
        if not (bad_every and i % bad_every == bad_every - 1)
    }


def data_config(pattern: str, **overrides) -> DataConfig:
    values = {"train_data": pattern, "batch_size": 4, "workers": 0, "shard_interleave": 2} | overrides
    return DataConfig(**values)
