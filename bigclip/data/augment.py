"""`--aug-cfg`: OpenCLIP's `AugmentationCfg` options, applied by bigclip's own transforms.

    --aug-cfg scale='(0.4, 1.0)' color_jitter='(0.32, 0.32, 0.32, 0.08)' color_jitter_prob=0.8 \
              gray_scale_prob=0.2 re_prob=0.25 re_count=1

Keys and value syntax are OpenCLIP's (`key=value`, values read with `ast.literal_eval`).
What each does, and where bigclip differs:
  scale, ratio        RandomResizedCrop's area and aspect ranges (OpenCLIP applies `ratio`
                      only through timm; bigclip always does; default (3/4, 4/3))
  color_jitter        torchvision's ColorJitter: brightness, contrast, saturation[, hue], a float
                      meaning the first three (timm's reading); random order, as torchvision
  color_jitter_prob   probability of jittering an image (default 1.0 when color_jitter is set:
                      timm's meaning; OpenCLIP without timm needs both)
  gray_scale_prob     probability of a 3-channel grayscale image
  re_prob, re_count   timm's RandomErasing (mode 'pixel', 1..re_count boxes, 2-33% of the area,
                      aspect 0.3-3.3, filled with N(0, 1) in normalised space); the boxes are
                      drawn in the data worker, the fill is done on the device (device.py)
  use_timm            accepted; bigclip implements the options itself, so it changes nothing
Every draw uses the sample's keyed generator (resume/randomness.py), so augmentations are
part of the exact, resumable stream.
"""

from __future__ import annotations

import ast
import math
import random
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance

from bigclip.errors import ConfigError

Box = tuple[int, int, int, int]  # (top, left, height, width)
ERASE_AREA = (0.02, 1 / 3)  # timm RandomErasing's defaults
ERASE_MIN_ASPECT = 0.3


def _pair(name: str, value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"--aug-cfg {name} must be a pair such as {name}='(0.9, 1.0)', got {value!r}"
        ) from None
    if not 0 < low <= high:
        raise ConfigError(f"--aug-cfg {name} must satisfy 0 < low <= high, got {value!r}")
    return low, high


def _jitter(value: Any) -> tuple[float, float, float, float] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value), float(value), float(value), 0.0
    try:
        values = [float(v) for v in value]
    except (TypeError, ValueError):
        values = []
    if len(values) not in (3, 4) or min(values) < 0 or (len(values) == 4 and values[3] > 0.5):
        raise ConfigError(
            "--aug-cfg color_jitter is brightness, contrast, saturation[, hue] (hue <= 0.5) or one float, "
            f"e.g. color_jitter='(0.32, 0.32, 0.32, 0.08)'; got {value!r}"
        )
    return tuple(values + [0.0] * (4 - len(values)))  # type: ignore[return-value]


def _probability(name: str, value: Any) -> float:
    if value is None:
        return 0.0
    if not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"--aug-cfg {name} is a probability in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Augmentation:
    scale: tuple[float, float] = (0.9, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    color_jitter: tuple[float, float, float, float] | None = None
    color_jitter_prob: float = 0.0
    gray_scale_prob: float = 0.0
    re_prob: float = 0.0
    re_count: int = 1
    use_timm: bool = False

    @classmethod
    def from_cfg(cls, cfg: dict[str, Any]) -> Augmentation:
        """From `--aug-cfg`'s dict (values may still be strings, e.g. from a YAML file)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ConfigError(f"--aug-cfg: unknown option(s) {unknown}; OpenCLIP's are {sorted(known)}")
        values = {k: _literal(v) for k, v in cfg.items() if v is not None}
        jitter = _jitter(values.get("color_jitter"))
        jitter_prob = values.get("color_jitter_prob")
        count = values.get("re_count", 1)
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"--aug-cfg re_count is a number of boxes >= 1, got {count!r}")
        return cls(
            scale=_pair("scale", values.get("scale")) or cls.scale,
            ratio=_pair("ratio", values.get("ratio")) or cls.ratio,
            color_jitter=jitter,
            color_jitter_prob=_probability("color_jitter_prob", jitter_prob) if jitter_prob is not None
            else float(jitter is not None),
            gray_scale_prob=_probability("gray_scale_prob", values.get("gray_scale_prob")),
            re_prob=_probability("re_prob", values.get("re_prob")),
            re_count=count,
            use_timm=bool(values.get("use_timm", False)),
        )  # fmt: skip


def _literal(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def color_jitter(
    image: Image.Image, factors: tuple[float, float, float, float], rng: random.Random
) -> Image.Image:
    """torchvision's ColorJitter on a PIL RGB image: each set factor drawn, applied in random order."""
    brightness, contrast, saturation, hue = factors
    ops = [
        (brightness, lambda im, f: ImageEnhance.Brightness(im).enhance(f), 1.0),
        (contrast, lambda im, f: ImageEnhance.Contrast(im).enhance(f), 1.0),
        (saturation, lambda im, f: ImageEnhance.Color(im).enhance(f), 1.0),
        (hue, _shift_hue, 0.0),
    ]
    rng.shuffle(ops)
    for amount, op, centre in ops:
        if amount > 0:
            low = max(0.0, centre - amount) if centre else -amount
            image = op(image, rng.uniform(low, centre + amount))
    return image


def _shift_hue(image: Image.Image, factor: float) -> Image.Image:
    """torchvision's adjust_hue for PIL: rotate the HSV hue channel (uint8, wrapping)."""
    h, s, v = image.convert("HSV").split()
    shifted = np.asarray(h, dtype=np.uint8) + np.uint8(int(factor * 255) % 256)
    return Image.merge("HSV", (Image.fromarray(shifted, "L"), s, v)).convert("RGB")


def apply_colour(image: Image.Image, aug: Augmentation, rng: random.Random) -> Image.Image:
    """OpenCLIP's order after the crop: colour jitter (with its probability), then grayscale."""
    if aug.color_jitter is not None and rng.random() < aug.color_jitter_prob:
        image = color_jitter(image, aug.color_jitter, rng)
    if aug.gray_scale_prob and rng.random() < aug.gray_scale_prob:
        image = image.convert("L").convert("RGB")
    return image


def erase_boxes(size: int, aug: Augmentation, rng: random.Random) -> list[Box]:
    """timm RandomErasing's boxes for a size x size image (empty when not erased)."""
    if not aug.re_prob or rng.random() > aug.re_prob:
        return []
    count = 1 if aug.re_count == 1 else rng.randint(1, aug.re_count)
    log_aspect = (math.log(ERASE_MIN_ASPECT), math.log(1 / ERASE_MIN_ASPECT))
    boxes = []
    for _ in range(count):
        for _ in range(10):
            area = rng.uniform(*ERASE_AREA) * size * size / count
            aspect = math.exp(rng.uniform(*log_aspect))
            h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if w < size and h < size:
                boxes.append((rng.randint(0, size - h), rng.randint(0, size - w), h, w))
                break
    return boxes
