"""The peer of benchmarks/data_loader.py: OpenCLIP's training data pipeline, step by step.

OpenCLIP's `open_clip_train.data.get_wds_dataset(is_train=True)` with
`open_clip.transform.image_transform(224, is_train=True)`, rebuilt here because both modules
import torchvision at the top, and torchvision cannot be installed on this CPU box (the
registry's wheel is a CUDA build). webdataset's own stages are used as OpenCLIP uses them
(webdataset is installed); the pieces OpenCLIP defines itself (`detshuffle2`,
`tarfile_to_samples_nothrow`, `filter_no_caption_or_no_image`) are copied as written, and
torchvision's transforms are written out with PIL + torch as torchvision runs them on PIL
images:
  RandomResizedCrop(224, scale=(0.9, 1.0), BICUBIC)  get_params with torch's RNG, then
                                                     `img.crop(box).resize(size, BICUBIC)`
  MaybeConvertMode('RGB')                             `img.convert('RGB')`
  ToTensor                                            `torch.from_numpy(np.array(img, copy=True))`
                                                     .view(h, w, 3).permute(2, 0, 1).contiguous()
                                                     .float().div(255)
  Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)  `tensor.clone().sub_(mean).div_(std)`
Shard and sample shuffles use OpenCLIP's buffer sizes; `wds.decode("pilrgb")` decodes and
converts to RGB; `wds.batched` stacks float32 images.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from webdataset.filters import _shuffle
from webdataset.tariterators import base_plus_ext, tar_file_expander, url_opener, valid_sample

_SHARD_SHUFFLE_SIZE, _SHARD_SHUFFLE_INITIAL = 2000, 500
_SAMPLE_SHUFFLE_SIZE, _SAMPLE_SHUFFLE_INITIAL = 5000, 1000
OPENAI_DATASET_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_DATASET_STD = (0.26862954, 0.26130258, 0.27577711)


def log_and_continue(exn: Exception) -> bool:
    return True


def group_by_keys_nothrow(data, keys=base_plus_ext, lcase=True, suffixes=None, handler=None):  # noqa: ANN001, ANN201
    current_sample = None
    for filesample in data:
        fname, value = filesample["fname"], filesample["data"]
        prefix, suffix = keys(fname)
        if prefix is None:
            continue
        if lcase:
            suffix = suffix.lower()
        if current_sample is None or prefix != current_sample["__key__"] or suffix in current_sample:
            if valid_sample(current_sample):
                yield current_sample
            current_sample = dict(__key__=prefix, __url__=filesample["__url__"])
        if suffixes is None or suffix in suffixes:
            current_sample[suffix] = value
    if valid_sample(current_sample):
        yield current_sample


def tarfile_to_samples_nothrow(src, handler=log_and_continue):  # noqa: ANN001, ANN201
    streams = url_opener(src, handler=handler)
    # eof_value=None: webdataset 1.0 (installed here) marks shard ends with {}, which OpenCLIP's
    # grouping (written for webdataset <= 0.2.86, its pinned range) does not expect.
    files = tar_file_expander(streams, handler=handler, eof_value=None)
    return group_by_keys_nothrow(files, handler=handler)


def filter_no_caption_or_no_image(sample: dict) -> bool:
    has_caption = "txt" in sample
    has_image = "png" in sample or "jpg" in sample or "jpeg" in sample or "webp" in sample
    return has_caption and has_image


class detshuffle2(wds.PipelineStage):  # noqa: N801 - OpenCLIP's name
    def __init__(self, bufsize: int = 1000, initial: int = 100, seed: int = 0, epoch: int = -1) -> None:
        self.bufsize, self.initial, self.seed, self.epoch = bufsize, initial, seed, epoch

    def run(self, src):  # noqa: ANN001, ANN201
        rng = random.Random()
        rng.seed(self.seed + self.epoch)
        return _shuffle(src, self.bufsize, self.initial, rng)


class RandomResizedCropBicubic:
    """torchvision's RandomResizedCrop on a PIL image (torch RNG, crop then PIL bicubic resize)."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.9, 1.0)) -> None:
        self.size, self.scale, self.ratio = size, scale, (3.0 / 4.0, 4.0 / 3.0)

    def get_params(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = float(width) / float(height)
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            w, h = int(round(height * max(self.ratio))), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Image.Image) -> Image.Image:
        i, j, h, w = self.get_params(*img.size)
        return img.crop((j, i, j + w, i + h)).resize((self.size, self.size), Image.Resampling.BICUBIC)


def to_tensor(pic: Image.Image) -> torch.Tensor:
    img = torch.from_numpy(np.array(pic, np.uint8, copy=True))
    img = img.view(pic.size[1], pic.size[0], 3).permute((2, 0, 1)).contiguous()
    return img.to(dtype=torch.get_default_dtype()).div(255)


def normalize(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    mean = torch.as_tensor(OPENAI_DATASET_MEAN, dtype=tensor.dtype).view(-1, 1, 1)
    std = torch.as_tensor(OPENAI_DATASET_STD, dtype=tensor.dtype).view(-1, 1, 1)
    return tensor.sub_(mean).div_(std)


def image_transform(image_size: int) -> Callable[[Image.Image], torch.Tensor]:
    crop = RandomResizedCropBicubic(image_size)
    return lambda img: normalize(to_tensor(crop(img).convert("RGB")))


def get_wds_loader(
    pattern: str,
    *,
    num_samples: int,
    batch_size: int,
    workers: int,
    image_size: int,
    tokenizer,
    seed: int = 0,
) -> wds.WebLoader:  # noqa: ANN001
    """get_wds_dataset(is_train=True, resampled=False) at world size 1, epoch 0."""
    preprocess_img = image_transform(image_size)
    pipeline = [
        wds.SimpleShardList(pattern),
        detshuffle2(bufsize=_SHARD_SHUFFLE_SIZE, initial=_SHARD_SHUFFLE_INITIAL, seed=seed, epoch=0),
        wds.split_by_node,
        wds.split_by_worker,
        tarfile_to_samples_nothrow,
        wds.shuffle(bufsize=_SAMPLE_SHUFFLE_SIZE, initial=_SAMPLE_SHUFFLE_INITIAL),
        wds.select(filter_no_caption_or_no_image),
        wds.decode("pilrgb", handler=log_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess_img, text=lambda text: tokenizer(text)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(batch_size, partial=False),
    ]
    dataset = wds.DataPipeline(*pipeline)
    num_batches = math.ceil(num_samples / batch_size)
    num_worker_batches = math.ceil(num_batches / max(1, workers))
    dataset = dataset.with_epoch(num_worker_batches)
    # persistent_workers=False (OpenCLIP: True): one epoch per pass, and the workers' CPU time is
    # only counted once they have exited.
    return wds.WebLoader(
        dataset, batch_size=None, shuffle=False, num_workers=workers, persistent_workers=False
    )
