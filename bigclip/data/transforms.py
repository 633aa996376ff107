"""Image transforms with PIL: pixels out as uint8 [H, W, 3]; normalisation happens on the device.

Training (`TrainTransform`): OpenCLIP's RandomResizedCrop(size, scale, ratio) with
torchvision's sampling (ten tries, then a centred crop), then `--aug-cfg`'s colour options.
Two ways to produce the crop, both from the same sampled box:
  exact  decode the whole image, convert to RGB, crop, resize bicubically: OpenCLIP's pipeline.
  fast   (default) decode JPEGs at reduced size with libjpeg's DCT scaling (PIL's `draft`,
         1/2, 1/4 or 1/8, the largest that keeps the crop at least `size` pixels), then crop
         and resize in one call (`resize(box=...)`, sub-pixel box, no intermediate crop),
         bilinear. PNG/WebP have no reduced decode and take the same call at full size.
         Quality, as PSNR against the exact path's result (OpenCLIP's full-resolution bicubic
         crop) on photo-like JPEGs: 46.7 dB (400-800 px) and 45.7 dB (1024-1600 px) on average
         over 200 images each, 41.6 dB at worst (benchmarks/data_loader.py); over other crops
         single images went down to 34 dB. tests/test_data_fast_transform.py holds it to
         >= 40 dB mean and >= 32 dB per image. For scale: JPEG q90 compression itself moves the
         exact 224 px result by 44-49 dB. Filter: bicubic after the reduced decode took 10-20%
         more time for < 1 dB on large images; libjpeg's fast IDCT and simplejpeg 1.9 were
         within 10% of PIL's `draft` here, so no extra dependency. Decode + crop + resize took
         2.5 ms instead of 4.9 (400-800 px) and 6.4 ms instead of 17 (1024-1600 px).
Evaluation (`EvalTransform`) stays exact, as OpenCLIP's `image_transform(is_train=False)`:
`--image-resize-mode shortest` (resize the short side, centre crop), `longest` (resize the long
side, pad with 0 and centre crop) or `squash`, with `--image-interpolation` (bicubic unless
'bilinear'; 'random' means bicubic here, as in OpenCLIP).

Images are converted to RGB before resizing, except 'L' (converting after is identical and
3x cheaper). OpenCLIP converts palette images after the crop, which resizes them with
nearest-neighbour; converting first resamples every image properly.
"""

from __future__ import annotations

import math
import random

import numpy as np
from PIL import Image

from bigclip.config.data import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # noqa: F401 (the data code's names for them)
from bigclip.data.augment import Augmentation, apply_colour

BICUBIC = Image.Resampling.BICUBIC
BILINEAR = Image.Resampling.BILINEAR
FAST_FILTER = BILINEAR
DCT_SCALES = (1, 2, 4, 8)  # smallest first: a 1-pixel side matches every scale

Box = tuple[int, int, int, int]  # (top, left, height, width), torchvision's order


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


def _rgb(image: Image.Image) -> Image.Image:
    """Modes other than RGB and L converted before any resampling (see the module doc)."""
    return image if image.mode in ("RGB", "L") else image.convert("RGB")


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))


def reduced_decode(image: Image.Image, crop_w: int, crop_h: int, size: int) -> tuple[Image.Image, int]:
    """`image` set to decode at 1/s of its size (JPEG only; others s = 1), the crop keeping >= size px."""
    width, height = image.size
    wanted = (math.ceil(width * size / crop_w), math.ceil(height * size / crop_h))
    if image.format != "JPEG" or image.draft("RGB", wanted) is None:
        return image, 1
    # The size PIL reports is ceil(full / s) for the scale libjpeg will use.
    scale = next(s for s in DCT_SCALES if -(-width // s) == image.width and -(-height // s) == image.height)
    return image, scale


class TrainTransform:
    """Random resized crop (+ colour augmentation) of a decoded or lazily opened PIL image."""

    def __init__(self, image_size: int, *, aug: Augmentation | None = None, fast: bool = True) -> None:
        self.image_size = image_size
        self.aug = aug or Augmentation()
        self.fast = fast

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> np.ndarray:
        """uint8 [size, size, 3]. Raises what PIL raises on a damaged image (the worker skips it)."""
        rng = rng or random.Random()
        top, left, h, w = random_resized_crop_box(
            *image.size, rng, scale=self.aug.scale, ratio=self.aug.ratio
        )
        size = (self.image_size, self.image_size)
        if self.fast:
            image, s = reduced_decode(image, w, h, self.image_size)
            image = _rgb(image)  # loads (at the reduced size)
            box = (left / s, top / s, min((left + w) / s, image.width), min((top + h) / s, image.height))
            out = image.resize(size, FAST_FILTER, box=box)
        else:
            out = image.convert("RGB").crop((left, top, left + w, top + h)).resize(size, BICUBIC)
        if self.aug.color_jitter is not None or self.aug.gray_scale_prob:
            out = apply_colour(out.convert("RGB"), self.aug, rng)
        return _pixels(out)


def shortest_side_size(width: int, height: int, size: int) -> tuple[int, int]:
    """torchvision's `Resize(size)` output (width, height): short side -> size, long side truncated."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def longest_side_size(width: int, height: int, size: int) -> tuple[int, int]:
    """OpenCLIP's `ResizeKeepRatio(size, longest=1)` output (width, height)."""
    ratio = max(width, height) / size
    return round(width / ratio), round(height / ratio)


def center_crop_box(width: int, height: int, size: int) -> Box:
    """torchvision's `CenterCrop(size)` for an image at least `size` on both sides."""
    return int(round((height - size) / 2.0)), int(round((width - size) / 2.0)), size, size


def center_crop_or_pad(image: Image.Image, size: int, *, fill: int = 0) -> Image.Image:
    """OpenCLIP's `center_crop_or_pad`: pad (left/top get the smaller half) to >= size, centre crop."""
    width, height = image.size
    if width < size or height < size:
        padded = Image.new(image.mode, (max(width, size), max(height, size)), (fill,) * len(image.getbands()))
        padded.paste(
            image, ((size - width) // 2 if width < size else 0, (size - height) // 2 if height < size else 0)
        )
        image, (width, height) = padded, padded.size
    top, left, h, w = center_crop_box(width, height, size)
    return image.crop((left, top, left + w, top + h))


class EvalTransform:
    """OpenCLIP's evaluation resize + centre crop (deterministic): uint8 [size, size, 3]."""

    def __init__(
        self, image_size: int, *, resize_mode: str = "shortest", interpolation: str = "bicubic"
    ) -> None:
        self.image_size = image_size
        self.resize_mode = resize_mode
        self.filter = BILINEAR if interpolation == "bilinear" else BICUBIC

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> np.ndarray:
        image, size = image.convert("RGB"), self.image_size
        if self.resize_mode == "squash":
            return _pixels(image.resize((size, size), self.filter))
        # After a shortest-side resize both sides are >= size: center_crop_or_pad only crops.
        fit = longest_side_size if self.resize_mode == "longest" else shortest_side_size
        return _pixels(center_crop_or_pad(image.resize(fit(*image.size, size), self.filter), size))


# The names the data code builds transforms by.
train_transform = TrainTransform
eval_transform = EvalTransform
