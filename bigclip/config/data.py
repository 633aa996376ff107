"""Where the training and held-out data come from and how samples become batches."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from braceexpand import UnbalancedBracesError, braceexpand

from bigclip.config.fields import TOKENIZERS, opt
from bigclip.errors import ConfigError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # --image-mean/--image-std when not given
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class DataConfig:
    train_data: str = opt("", "Training shards (a brace pattern), local or s3://: /data/{00000..00099}.tar.")
    val_data: str = opt("", "Held-out shards for retrieval evaluation (same pattern syntax).")
    train_num_samples: int = opt(0, "Samples per epoch (0: read sizes.json beside the shards).")
    val_num_samples: int = opt(0, "Held-out samples to evaluate (0: all).")
    val_retrieval_chunk_size: int = opt(
        4096, "Score held-out retrieval N rows at a time (less memory, same result; 0: all at once)."
    )
    val_retrieval_precision: str = opt(
        "fp32",
        "Held-out retrieval scores in fp32 or in the features' dtype ('model').",
        choices=("fp32", "model"),
    )
    val_frequency: int = opt(1, "Evaluate --val-data every N epochs and after the last (0: never).")
    imagenet_val: str = opt(
        "",
        "Zero-shot classification set: an ImageNet-layout folder or shards with .cls labels "
        "(classnames.txt beside them for non-ImageNet classes).",
    )
    imagenet_v2: str = opt("", "ImageNet-V2 for zero-shot: the folder holding ImageNetV2-matched-frequency/.")
    zeroshot_frequency: int = opt(
        2, "Run zero-shot classification every N epochs and after the last one (0: never)."
    )
    dataset_type: str = opt(
        "webdataset", "Data format (OpenCLIP's 'auto': webdataset).", choices=("webdataset",)
    )
    image_key: str = opt(
        "jpg;png;jpeg;webp",
        "Tar member suffix holding the image, ';'-separated alternatives (the first present wins), "
        "e.g. 'webp' or 'image.png'.",
    )
    text_key: str = opt(
        "txt",
        "Tar member suffix holding the caption, ';'-separated alternatives, e.g. 'caption.txt;txt'.",
    )
    dataset_resampled: bool = opt(False, "Sample shards with replacement (an endless stream).")
    workers: int = opt(4, "Data-loader worker processes per rank.")
    batch_size: int = opt(64, "Batch size per GPU (per rank).")
    tokenizer: str = opt(
        "open_clip",
        "Text tokenizer: OpenCLIP's BPE ('open_clip': the ids its weights know) or 'hashing' (no "
        "vocabulary: for models trained from scratch).",
        choices=TOKENIZERS,
    )
    shard_interleave: int = opt(
        4,
        "Shards each data worker reads at once, taking samples from them in random order "
        "(mixing without a shuffle buffer, which keeps resume exact).",
    )
    train_data_upsampling_factors: str = opt(
        "",
        "With --dataset-resampled and several '::'-separated --train-data sources: one weight per "
        "source, e.g. 1::2::0.5 (OpenCLIP's semantics).",
    )
    image_mean: list[float] = opt([], "Normalisation mean, one value or R G B (default: OpenAI CLIP's).")
    image_std: list[float] = opt([], "Normalisation std, one value or R G B (default: OpenAI CLIP's).")
    image_interpolation: str = opt(
        "bicubic",
        "Evaluation resize filter ('random' is bicubic there, as in OpenCLIP); training uses --train-transform's.",
        choices=("bicubic", "bilinear", "random"),
    )
    image_resize_mode: str = opt(
        "shortest",
        "Evaluation resize: shortest side + centre crop, longest side + pad, or squash.",
        choices=("shortest", "longest", "squash"),
    )
    aug_cfg: dict = opt(
        {},
        "OpenCLIP's training augmentation: scale ratio color_jitter color_jitter_prob gray_scale_prob "
        "re_prob re_count use_timm, e.g. scale='(0.4,1.0)'.",
    )
    train_transform: str = opt(
        "fast",
        "Training crop: 'fast' (JPEG decoded at reduced size, bilinear) or 'exact' (OpenCLIP's full "
        "decode + bicubic).",
        choices=("fast", "exact"),
    )

    def evaluation_sets(self) -> dict[str, int]:
        """The evaluation sets given, as {flag: its frequency in epochs} (0: never evaluated)."""
        given = {"--val-data": (self.val_data, self.val_frequency),
                 "--imagenet-val": (self.imagenet_val, self.zeroshot_frequency),
                 "--imagenet-v2": (self.imagenet_v2, self.zeroshot_frequency)}  # fmt: skip
        return {flag: every for flag, (value, every) in given.items() if value.strip()}

    def validate(self) -> None:
        if self.train_data_upsampling_factors and not self.dataset_resampled:
            raise ConfigError(
                "--train-data-upsampling-factors needs --dataset-resampled (shards drawn with replacement), "
                "as in OpenCLIP"
            )
        if self.shard_interleave < 1:
            raise ConfigError(f"--shard-interleave must be at least 1, got {self.shard_interleave}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1 (samples per rank), got {self.batch_size}")
        if self.workers < 0:
            raise ConfigError(f"--workers must be 0 or more, got {self.workers}")
        if self.train_num_samples < 0 or self.val_num_samples < 0:
            raise ConfigError("--train-num-samples and --val-num-samples must be 0 (auto) or positive")
        if self.val_retrieval_chunk_size < 0:
            raise ConfigError(f"--val-retrieval-chunk-size must be 0 (all at once) or more, got "
                              f"{self.val_retrieval_chunk_size}")  # fmt: skip
        if self.val_frequency < 0 or self.zeroshot_frequency < 0:
            raise ConfigError("--val-frequency and --zeroshot-frequency must be 0 (never) or positive")
        for flag, value in (("--image-key", self.image_key), ("--text-key", self.text_key)):
            if not value.replace(";", "").strip():
                raise ConfigError(f"{flag} {value!r}: name the tar member suffix, e.g. {flag} txt")
        for flag, pattern in (("--train-data", self.train_data), ("--val-data", self.val_data),
                              ("--imagenet-val", self.imagenet_val)):  # fmt: skip
            _check_pattern(flag, pattern)
        self._check_upsampling()
        if self.image_mean or self.image_std:  # (a flag not given: OpenAI CLIP's, in range; checked as such)
            check_channels(channel_values(self.image_mean, OPENAI_CLIP_MEAN, flag="--image-mean"),
                           channel_values(self.image_std, OPENAI_CLIP_STD, flag="--image-std"))  # fmt: skip
        if self.tokenizer not in TOKENIZERS:  # e.g. from a YAML file or an old checkpoint's config
            raise ConfigError(f"--tokenizer {self.tokenizer!r}: use one of {', '.join(TOKENIZERS)}")

    def _check_upsampling(self) -> None:
        """One non-negative number per '::' source of --train-data, not all zero (OpenCLIP's rule)."""
        factors = self.train_data_upsampling_factors
        if not factors or not self.train_data:
            return
        sources = self.train_data.split("::")
        try:
            values = [float(f) for f in factors.split("::")]
        except ValueError:
            values = []
        if len(values) != len(sources) or not all(0 <= v < math.inf for v in values) or max(values) == 0:
            raise ConfigError(
                f"--train-data-upsampling-factors {factors!r} needs one non-negative number per '::' source of "
                f"--train-data ({len(sources)} source(s)), not all zero, e.g. {'::'.join(['1'] * len(sources))}"
            )


def channel_values(values: Sequence[float], default: Sequence[float], *, flag: str) -> tuple[float, ...]:
    """`--image-mean`/`--image-std`: empty -> default; one value -> all channels; else three."""
    if not values:
        return tuple(default)
    if len(values) == 1:
        return (float(values[0]),) * 3
    if len(values) != 3:
        raise ConfigError(f"{flag} takes one value or three (R G B), got {list(values)}")
    return tuple(float(v) for v in values)


def check_channels(mean: Sequence[float], std: Sequence[float]) -> None:
    """Normalisation values on the [0, 1] scale images are brought to (OpenCLIP's ToTensor)."""
    if any(not s > 0 for s in std):
        raise ConfigError(f"--image-std values must be positive, got {list(std)}")
    if any(not 0 <= m <= 1 for m in mean) or any(s > 1 for s in std):  # every input would be ~-2
        raise ConfigError(
            f"--image-mean {list(mean)} --image-std {list(std)}: images are scaled to [0, 1] before they are "
            "normalised, as in OpenCLIP; give values on that scale (0-255 values divided by 255, e.g. "
            "--image-mean 0.485 0.456 0.406 --image-std 0.229 0.224 0.225)"
        )


def _check_pattern(flag: str, pattern: str) -> None:
    """A shard pattern's braces must pair up (else braceexpand raises deep inside the data loader),
    and it must name a shard (`::`, or only spaces: refused here, before torch is imported)."""
    if not pattern.strip():
        return  # not given (each flag's own check says whether it must be)
    named = False
    for source in pattern.split("::"):
        try:
            first = next((u for u in braceexpand(source) if u.strip()), None)
        except UnbalancedBracesError:
            raise ConfigError(
                f"{flag} {pattern!r}: unbalanced braces in {source!r}; close each range, e.g. "
                "/data/{00000..00099}.tar"
            ) from None
        named = named or first is not None
    if not named:
        raise ConfigError(names_no_shard(flag, pattern))


def names_no_shard(flag: str, pattern: str) -> str:
    return (f"{flag} {pattern!r} names no shard (every part of it is empty); give a shard pattern such as "
            "/data/{00000..00099}.tar")  # fmt: skip
