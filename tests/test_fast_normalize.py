"""The loader's normalisation on a CPU device: the same values as before, in less time (issue 24).

Where the device is the CPU (demo, CPU runs) the training process normalises each batch between
steps. ImageNormalizer now transposes the uint8 batch, converts it once and does the arithmetic
in place; these tests hold it to the previous implementation's exact values (fp32 and bf16, with
and without random-erasing boxes). How much faster it is, is benchmarks/normalize_cpu.py's to say
(a timing assertion here failed on a loaded box: no timings in tests).
"""

from __future__ import annotations

import pytest
import torch

from bigclip.config import DataConfig
from bigclip.data.device import image_normalizer, to_float_nchw
from bigclip.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

MEAN = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)


def previous(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ImageNormalizer at main 97074c7 (no erase): float transpose, out-of-place arithmetic."""
    x = images.permute(0, 3, 1, 2).float()
    x = (x / torch.full((1, 1, 1, 1), 255.0) - MEAN) / STD
    return x.to(dtype, memory_format=torch.contiguous_format)


def batch(n: int = 6, h: int = 40, w: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_are_bitwise_the_previous_ones(dtype):
    images = batch()
    new = image_normalizer(DataConfig(), dtype=dtype)(images)
    assert new.dtype == dtype and new.is_contiguous() and new.shape == (6, 3, 40, 24)
    assert torch.equal(new, previous(images, dtype))


def test_every_uint8_value_converts_exactly():
    values = torch.arange(256, dtype=torch.uint8).view(1, 16, 16, 1).expand(2, 16, 16, 3)
    x = to_float_nchw(values)
    assert x.dtype == torch.float32 and x.is_contiguous()
    assert torch.equal(x, values.permute(0, 3, 1, 2).float())


def test_erased_boxes_are_noise_and_the_rest_unchanged():
    images = batch()
    erase = torch.zeros(6, 1, 5, dtype=torch.int64)
    erase[2, 0] = torch.tensor([3, 4, 10, 8, 99])  # top, left, height, width, seed
    new = image_normalizer(DataConfig(), dtype=torch.bfloat16)(images, erase)
    old = previous(images, torch.bfloat16)
    inside = torch.zeros(6, 1, 40, 24, dtype=torch.bool)
    inside[2, :, 3:13, 4:12] = True
    assert torch.equal(new[~inside.expand_as(new)], old[~inside.expand_as(old)])
    assert not torch.equal(new[2, :, 3:13, 4:12], old[2, :, 3:13, 4:12])
