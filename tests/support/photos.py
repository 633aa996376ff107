"""Photo-like JPEGs for benchmarks and tests of the image path: sizes and bytes like LAION's.

A flat synthetic image decodes and compresses unlike a photo (JPEG cost follows the entropy
of the content). These have what photos have: smooth colour gradients, a dozen blurred
shapes with edges, and sensor-like grain (luma and chroma noise), saved at quality ~90:
a 580 x 470 image is ~100 KB and a 1400 x 1100 one ~400 KB, as in LAION shards.

    write_photo_shards(out_dir, samples=3072, shards=8, long_side=(400, 800), seed=0)
      -> out_dir/{00000..00007}.tar (KEY.jpg, KEY.txt, KEY.json per sample) + sizes.json
"""

from __future__ import annotations

import io
import json
import math
import os
import tarfile

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from bigclip.data.shards import SIZES_FILE

WORDS = ("a photo of", "a red", "blue", "car", "dog", "on the", "beach", "at night", "mountain", "city")


class _Grain:
    """One field of sensor-like noise (luma + chroma), cropped at random offsets: drawing fresh
    normal noise for every large image would cost more than everything else together."""

    def __init__(self, rng: np.random.Generator, side: int = 1700) -> None:
        self.field = (
            rng.standard_normal((side, side, 1), dtype=np.float32) * 6
            + rng.standard_normal((side, side, 3), dtype=np.float32) * 3
        )

    def crop(self, rng: np.random.Generator, width: int, height: int) -> np.ndarray:
        side = self.field.shape[0]
        top, left = int(rng.integers(0, side - height + 1)), int(rng.integers(0, side - width + 1))
        return self.field[top : top + height, left : left + width]


_GRAIN: list[_Grain] = []  # made on first use, the same in every process (fixed seed)


def photo(rng: np.random.Generator, long_side: int) -> Image.Image:
    """One photo-like RGB image whose longer side is `long_side` (<= 1700; aspect 0.6-1)."""
    short = int(long_side * rng.uniform(0.6, 1.0))
    width, height = (long_side, short) if rng.random() < 0.6 else (short, long_side)
    xs, ys = np.arange(width, dtype=np.float32) / width, np.arange(height, dtype=np.float32) / height
    base = np.empty((height, width, 3), np.float32)
    for c in range(3):  # sin(u + v) = sin u cos v + cos u sin v: two outer products, not H x W sines
        a, b, phase = rng.uniform(-1, 1, 3)
        u, v = 3 * a * xs + 6 * phase, 3 * b * ys
        base[..., c] = 128 + 60 * (np.outer(np.cos(v), np.sin(u)) + np.outer(np.sin(v), np.cos(u)))
    image = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(6, 14))):
        x, y, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(0.05, 0.3) * long_side
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)
        else:
            angles = rng.uniform(0, 2 * math.pi, 5)
            draw.polygon([(x + r * math.cos(t), y + r * math.sin(t)) for t in angles], fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 2.0)))
    if not _GRAIN:
        _GRAIN.append(_Grain(np.random.default_rng(12345)))
    grain = _GRAIN[0].crop(rng, width, height)
    return Image.fromarray((np.asarray(image, np.float32) + grain).clip(0, 255).astype(np.uint8))


def photo_jpeg(rng: np.random.Generator, long_side: int, *, quality: int = 90) -> bytes:
    out = io.BytesIO()
    photo(rng, long_side).save(out, "JPEG", quality=quality)
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_photo_shards(
    out_dir: str, *, samples: int, shards: int, long_side: tuple[int, int], seed: int = 0
) -> str:
    """Plain LAION-style shards of photo-like JPEGs; returns the brace pattern of the shards."""
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = {}
    for shard in range(shards):
        name = f"{shard:05d}.tar"
        count = samples // shards + (shard < samples % shards)
        with tarfile.open(os.path.join(out_dir, name), "w") as tar:
            for i in range(count):
                key = f"{shard:05d}{i:04d}"
                caption = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))
                _add(tar, f"{key}.jpg", photo_jpeg(rng, int(rng.integers(long_side[0], long_side[1] + 1))))
                _add(tar, f"{key}.txt", caption.encode())
                _add(tar, f"{key}.json", json.dumps({"key": key, "caption": caption}).encode())
        sizes[name] = count
    with open(os.path.join(out_dir, SIZES_FILE), "w") as f:
        json.dump(sizes, f)
    return os.path.join(out_dir, f"{{00000..{shards - 1:05d}}}.tar")
