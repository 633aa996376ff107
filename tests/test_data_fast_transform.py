"""The fast image path against the exact one, normalisation on the device, and --aug-cfg."""

import io
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from support.photos import photo, photo_jpeg

from bigclip.config import DataConfig
from bigclip.data.augment import Augmentation, erase_boxes
from bigclip.data.decode import decode_image
from bigclip.data.device import ImageNormalizer, image_normalizer
from bigclip.data.transforms import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    eval_transform,
    reduced_decode,
    train_transform,
)
from bigclip.errors import ConfigError

# The quality bound of the fast path (transforms.py): PSNR against OpenCLIP's exact crop.
MEAN_PSNR_DB, MIN_PSNR_DB = 40.0, 32.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def old_float_path(pixels: np.ndarray) -> torch.Tensor:
    """bigclip's host-side normalisation before issue 15 (ToTensor + Normalize, numpy float32)."""
    array = pixels.astype(np.float32) / 255.0
    mean, std = np.asarray(OPENAI_CLIP_MEAN, np.float32), np.asarray(OPENAI_CLIP_STD, np.float32)
    return torch.from_numpy(((array - mean) / std).transpose(2, 0, 1).copy())


@pytest.mark.parametrize("long_side", [(400, 800), (1024, 1600)])
def test_fast_path_agrees_with_the_exact_path_within_the_stated_bound(long_side):
    rng = np.random.default_rng(long_side[0])
    fast, exact = train_transform(224), train_transform(224, fast=False)
    values, reduced = [], 0
    for i in range(8):
        data = photo_jpeg(rng, int(rng.integers(*long_side)))
        a = fast(decode_image(data, load=False), random.Random(i))
        b = exact(decode_image(data, load=False), random.Random(i))
        assert a.shape == b.shape == (224, 224, 3) and a.dtype == np.uint8
        values.append(psnr(a, b))
        opened = decode_image(data, load=False)
        reduced += reduced_decode(opened, int(0.95 * opened.width), int(0.95 * opened.height), 224)[1] > 1
    assert np.mean(values) >= MEAN_PSNR_DB and min(values) >= MIN_PSNR_DB, values
    assert reduced == 8 if long_side[0] > 1000 else reduced > 0  # decoded at reduced size


def test_png_and_webp_take_the_full_size_fallback():
    image = photo(np.random.default_rng(0), 600)
    for fmt in ("PNG", "WEBP"):
        out = io.BytesIO()
        image.save(out, fmt)
        opened = decode_image(out.getvalue(), load=False)
        assert reduced_decode(opened, 500, 400, 224)[1] == 1
        a = train_transform(224)(opened, random.Random(1))
        b = train_transform(224, fast=False)(decode_image(out.getvalue()), random.Random(1))
        assert psnr(a, b) >= MEAN_PSNR_DB


def test_eval_images_normalised_on_the_device_are_bitwise_the_old_eval_transform():
    image = photo(np.random.default_rng(1), 500)
    resized = image.resize((224, int(224 * image.height / image.width)), Image.Resampling.BICUBIC)
    top = int(round((resized.height - 224) / 2.0))
    old = old_float_path(np.asarray(resized.crop((0, top, 224, top + 224))))
    pixels = torch.from_numpy(eval_transform(224)(image).copy())
    new = image_normalizer(DataConfig())(pixels[None])[0]
    assert torch.equal(new, old)


def test_uint8_batches_normalised_on_the_device_equal_the_old_float_path():
    pixels = torch.randint(0, 256, (4, 32, 24, 3), dtype=torch.uint8)
    old = torch.stack([old_float_path(p.numpy()) for p in pixels])
    new = image_normalizer(DataConfig())(pixels)
    assert new.shape == (4, 3, 32, 24) and new.is_contiguous()
    assert (new - old).abs().max() <= 1e-6
    bf16 = image_normalizer(DataConfig(), dtype=torch.bfloat16)(pixels)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, old.to(torch.bfloat16))  # as the model's cast


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_uint8_batch_normalised_on_cuda_equals_the_old_float_path():
    pixels = torch.randint(0, 256, (8, 64, 64, 3), dtype=torch.uint8).pin_memory()
    new = image_normalizer(DataConfig(), device="cuda")(pixels)
    old = torch.stack([old_float_path(p.numpy()) for p in pixels])
    assert new.device.type == "cuda" and (new.cpu() - old).abs().max() <= 1e-6


def test_image_mean_and_std_flags():
    cfg = DataConfig(image_mean=[0.5], image_std=[0.25, 0.5, 1.0])
    out = image_normalizer(cfg)(torch.full((1, 2, 2, 3), 255, dtype=torch.uint8))
    assert out[0, :, 0, 0].tolist() == [2.0, 1.0, 0.5]
    with pytest.raises(ConfigError, match="one value or three"):
        image_normalizer(DataConfig(image_mean=[0.1, 0.2]))


def test_aug_cfg_parses_openclip_values_and_refuses_unknown_ones():
    aug = Augmentation.from_cfg({"scale": (0.4, 1.0), "ratio": "(0.5, 2.0)", "color_jitter": 0.4})
    assert aug.scale == (0.4, 1.0) and aug.ratio == (0.5, 2.0)
    assert aug.color_jitter == (0.4, 0.4, 0.4, 0.0) and aug.color_jitter_prob == 1.0  # timm's reading
    for bad, match in [({"scael": (0.4, 1.0)}, "unknown option"), ({"scale": 0.5}, "pair"),
                       ({"gray_scale_prob": 2}, "probability"), ({"color_jitter": (1, 2)}, "brightness")]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            Augmentation.from_cfg(bad)


def test_colour_augmentations_apply_with_their_probabilities():
    image = photo(np.random.default_rng(2), 300)
    gray = train_transform(64, aug=Augmentation.from_cfg({"gray_scale_prob": 1.0}))(
        image.copy(), random.Random(0)
    )
    assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()
    plain = train_transform(64)(image.copy(), random.Random(0))
    jitter = Augmentation.from_cfg({"color_jitter": (0.4, 0.4, 0.4, 0.1), "color_jitter_prob": 1.0})
    assert not np.array_equal(train_transform(64, aug=jitter)(image.copy(), random.Random(0)), plain)
    never = Augmentation.from_cfg({"color_jitter": (0.4, 0.4, 0.4, 0.1), "color_jitter_prob": 0.0})
    np.testing.assert_array_equal(train_transform(64, aug=never)(image.copy(), random.Random(0)), plain)


def test_random_erasing_fills_its_boxes_with_noise_on_the_device():
    aug = Augmentation.from_cfg({"re_prob": 1.0, "re_count": 2})
    boxes = erase_boxes(32, aug, random.Random(5))
    assert 1 <= len(boxes) <= 2 and all(h < 32 and w < 32 for _, _, h, w in boxes)
    erase = torch.zeros(1, 2, 5, dtype=torch.long)
    for k, box in enumerate(boxes):
        erase[0, k] = torch.tensor([*box, 7])
    pixels = torch.full((1, 32, 32, 3), 128, dtype=torch.uint8)
    plain = ImageNormalizer(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)(pixels)
    erased = ImageNormalizer(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)(pixels, erase)
    top, left, h, w = boxes[0]
    assert not torch.equal(
        erased[..., top : top + h, left : left + w], plain[..., top : top + h, left : left + w]
    )
    outside = torch.ones(32, 32, dtype=torch.bool)
    for top, left, h, w in boxes:
        outside[top : top + h, left : left + w] = False
    assert torch.equal(erased[..., outside], plain[..., outside])
    assert not erase_boxes(32, Augmentation.from_cfg({"re_prob": 0.0}), random.Random(5))
