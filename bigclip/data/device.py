"""Images onto the device: uint8 [B, H, W, 3] in pinned host memory -> normalised [B, 3, H, W].

Workers send uint8 (a quarter of float32's bytes through shared memory, the pinning copy and
PCIe); here the batch is copied non-blocking from pinned memory, and the ToTensor scaling,
the mean/std normalisation and the cast to the dtype the model's first layer takes (the
engine's `image_dtype`) run on the device. The arithmetic is the old host path's, op for op
in float32 ((x / 255 - mean) / std, 255 a device tensor so that CUDA divides rather than
multiplying by a reciprocal), so fp32 results are bitwise those of OpenCLIP's ToTensor +
Normalize on a CPU; the cast comes last, as the model's own cast did before. Where the
device is the CPU (demo and CPU runs) this runs in the training process, between steps, so it
is kept to one pass per operation: the uint8 batch is transposed, converted once (`to_float_nchw`)
and the arithmetic runs in place, without temporaries (2-3x less time than the float transpose
and out-of-place arithmetic it replaces; benchmarks/normalize_cpu.py).

`--aug-cfg re_prob`: boxes drawn in the workers (augment.erase_boxes) are filled here with
N(0, 1) noise in normalised space (timm's 'pixel' mode), from a generator seeded by the batch
(its first sample's seed), so the training process's RNG streams are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from bigclip.config import DataConfig
from bigclip.config.data import channel_values, check_channels
from bigclip.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD


class ImageNormalizer:
    def __init__(
        self,
        *,
        mean: Sequence[float],
        std: Sequence[float],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        check_channels(mean, std)  # values from a pretrained model's preprocessing config, too
        self.device, self.dtype = torch.device(device), dtype
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self.scale = torch.full((1, 1, 1, 1), 255.0, device=self.device)

    def __call__(self, images: torch.Tensor, erase: torch.Tensor | None = None) -> torch.Tensor:
        """`images` uint8 [B, H, W, 3] (pinned for a non-blocking copy); `erase` int [B, K, 5] or None."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected uint8 [B, H, W, 3] images, got {images.dtype} {list(images.shape)}")
        x = to_float_nchw(images.to(self.device, non_blocking=True))
        x = x.div_(self.scale).sub_(self.mean).div_(self.std)  # in place: no temporaries
        if erase is not None and erase.numel() and bool((erase[..., 3] > 0).any()):
            x = self._erase(x, erase.to(self.device, non_blocking=True))
        return x.to(self.dtype, memory_format=torch.contiguous_format)

    def _erase(self, x: torch.Tensor, erase: torch.Tensor) -> torch.Tensor:
        """Rows of `erase`: (top, left, height, width, seed); height 0 means no box."""
        rows = torch.arange(x.shape[2], device=x.device).view(1, 1, -1, 1)
        cols = torch.arange(x.shape[3], device=x.device).view(1, 1, 1, -1)
        top, left, h, w = (erase[..., i, None, None] for i in range(4))  # [B, K, 1, 1]
        inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
        mask = inside.any(dim=1, keepdim=True)  # [B, 1, H, W]
        generator = torch.Generator(device=x.device).manual_seed(int(erase[0, 0, 4]))
        noise = torch.randn(x.shape, generator=generator, device=x.device)
        return torch.where(mask, noise, x)


def to_float_nchw(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float32 [B, 3, H, W], contiguous, values unchanged (exact).

    Transposed while still uint8 (a quarter of float32's bytes). On a CPU the conversion goes
    through numpy: torch's uint8 -> float32 copy is not vectorised there (about 2 ns per element,
    20 ms for a batch of 64 224-px images, against numpy's 5-8 ms; benchmarks/normalize_cpu.py)."""
    x = images.permute(0, 3, 1, 2).contiguous()
    if x.device.type != "cpu":
        return x.float()
    out = torch.empty(x.shape, dtype=torch.float32)
    np.copyto(out.numpy(), x.numpy(), casting="unsafe")
    return out


def image_normalizer(
    cfg: DataConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ImageNormalizer:
    """The normaliser for a run's `--image-mean` / `--image-std` (OpenAI CLIP's by default)."""
    mean = channel_values(cfg.image_mean, OPENAI_CLIP_MEAN, flag="--image-mean")
    std = channel_values(cfg.image_std, OPENAI_CLIP_STD, flag="--image-std")
    return ImageNormalizer(mean=mean, std=std, device=device, dtype=dtype)
