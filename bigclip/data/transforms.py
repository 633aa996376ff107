"""Image transforms with PIL + numpy/torch, matching OpenCLIP's defaults without torchvision.

Training: RandomResizedCrop(image_size, scale=(0.9, 1.0), ratio=(3/4, 4/3), bicubic)
(torchvision's sampling algorithm, including its centre-crop fallback). Evaluation:
resize the shortest side to image_size (bicubic), then centre crop. Both end with
ToTensor (uint8 HWC -> float CHW in [0, 1]) and CLIP's mean/std.

One deliberate difference: images are converted to RGB *before* resizing. OpenCLIP
converts after, which makes PIL resize palette ('P') images with nearest-neighbour;
converting first resamples every image bicubically.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = Image.Resampling.BICUBIC

Box = tuple[int, int, int, int]  # (top, left, height, width), torchvision's order


def to_normalized_tensor(image: Image.Image) -> torch.Tensor:
    """PIL RGB image -> float32 [3, H, W], CLIP-normalised."""
    array = np.asarray(image, dtype=np.float32) / 255.0
    mean = np.asarray(OPENAI_CLIP_MEAN, dtype=np.float32)
    std = np.asarray(OPENAI_CLIP_STD, dtype=np.float32)
    return torch.from_numpy(((array - mean) / std).transpose(2, 0, 1).copy())


def random_resized_crop_box(
    width: int,
    height: int,
    rng: random.Random,
    *,
    scale: tuple[float, float] = (0.9, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Box:
    """torchvision's `RandomResizedCrop.get_params`: ten tries, then a centre crop within `ratio`."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TrainTransform:
    """Random resized crop + normalisation. Pass `rng` for reproducible crops (data workers do)."""

    def __init__(self, image_size: int, *, scale: tuple[float, float] = (0.9, 1.0)) -> None:
        self.image_size = image_size
        self.scale = scale

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        image = image.convert("RGB")
        top, left, h, w = random_resized_crop_box(*image.size, rng or random.Random(), scale=self.scale)
        crop = image.crop((left, top, left + w, top + h))
        return to_normalized_tensor(crop.resize((self.image_size, self.image_size), BICUBIC))


def shortest_side_size(width: int, height: int, size: int) -> tuple[int, int]:
    """torchvision's `Resize(size)` output (width, height): short side -> size, long side truncated."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def center_crop_box(width: int, height: int, size: int) -> Box:
    """torchvision's `CenterCrop(size)` for an image at least `size` on both sides."""
    return int(round((height - size) / 2.0)), int(round((width - size) / 2.0)), size, size


class EvalTransform:
    """Resize the shortest side to image_size, centre crop, normalise (deterministic)."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        image = image.convert("RGB")
        image = image.resize(shortest_side_size(*image.size, self.image_size), BICUBIC)
        top, left, h, w = center_crop_box(*image.size, self.image_size)
        return to_normalized_tensor(image.crop((left, top, left + w, top + h)))


def train_transform(image_size: int) -> TrainTransform:
    return TrainTransform(image_size)


def eval_transform(image_size: int) -> EvalTransform:
    return EvalTransform(image_size)
