"""Zero-shot classification as OpenCLIP's trainer runs it (`open_clip_train/zero_shot.py`):
class names x prompt templates -> text embeddings, normalised, averaged per class and normalised
again -> a classifier; images are classified by 100 * image features @ classifier; top-1/top-5.

Every `--zeroshot-frequency` epochs and after the last one, on `--imagenet-val` and
`--imagenet-v2`, logged as OpenCLIP names them (`imagenet-zeroshot-val-top1`, ...,
`imagenetv2-zeroshot-val-top5`). OpenCLIP runs it on rank 0 alone; here every rank embeds a
slice of the classes (gathered into one classifier) and of the images (counts summed), and the
ranks make the same number of forwards (dummy batches where a share ran out), since a sharded
model needs every rank in every forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from bigclip.config import TrainConfig
from bigclip.data.classification import (
    BAD_LABEL,
    SKIPPED,
    UNLABELLED,
    ClassificationSet,
    open_classification_set,
)
from bigclip.data.device import ImageNormalizer
from bigclip.data.tokenizer import Tokenizer
from bigclip.distributed import Runtime, on_rank0
from bigclip.engines import Engine
from bigclip.models.run_options import image_size
from bigclip.train.metrics import get_logger

METRIC_NAMES = {"imagenet_val": "imagenet-zeroshot-val", "imagenet_v2": "imagenetv2-zeroshot-val"}
CLASSES_PER_BATCH = 10  # OpenCLIP's num_classes_per_batch


@dataclass
class ZeroShot:
    sets: dict[str, ClassificationSet] = field(default_factory=dict)  # metric name prefix -> set
    frequency: int = 0
    epochs: int = 0
    resize: dict[str, str] = field(default_factory=dict)  # --image-resize-mode, --image-interpolation
    image_size: int = 0  # the model's (its --force-image-size applied)

    @classmethod
    def open(cls, cfg: TrainConfig) -> ZeroShot:
        """Checks the sets exist and have class names, before any model is built."""
        sets = on_rank0(  # rank 0 lists and reads them once for the job (collective)
            lambda: {
                prefix: open_classification_set(getattr(cfg.data, flag), what=f"--{flag.replace('_', '-')}")
                for flag, prefix in METRIC_NAMES.items()
                if getattr(cfg.data, flag)
            }
        )
        resize = {"resize_mode": cfg.data.image_resize_mode, "interpolation": cfg.data.image_interpolation}
        size = image_size(cfg) if sets else 0
        return cls(sets, cfg.data.zeroshot_frequency, cfg.optim.epochs, resize, size)

    def due(self, epoch: int, *, final: bool) -> bool:
        """OpenCLIP's rule: every `frequency` epochs and at the last one (0: never)."""
        if not self.sets or not self.frequency:
            return False
        return final or epoch % self.frequency == 0 or epoch == self.epochs

    def evaluate(
        self, engine: Engine, tokenizer: Tokenizer, runtime: Runtime, *, normalize: ImageNormalizer,
        batch_size: int, workers: int,
    ) -> dict[str, float]:  # fmt: skip
        """Collective: top-1/top-5 on every set (the model in eval mode meanwhile)."""
        was_training = engine.module.training
        engine.eval()
        metrics = {}
        try:
            for prefix, data in self.sets.items():
                classifier = build_classifier(engine, tokenizer, data, runtime)
                loader = data.loader(
                    rank=runtime.rank, world_size=runtime.world_size, image_size=self.image_size,
                    batch_size=batch_size, workers=workers, **self.resize,
                )  # fmt: skip
                scored = classify(
                    engine, classifier, loader, runtime, normalize=normalize, image_size=self.image_size
                )
                if scored.left_out():
                    get_logger().warning(f"zero-shot {data.uri}: not scored: {scored.left_out()}")
                if scored.images:
                    metrics |= {f"{prefix}-top1": scored.top1, f"{prefix}-top5": scored.top5}
                else:  # not 0.0: there was nothing to score
                    get_logger().warning(
                        f"zero-shot {data.uri}: no image could be scored; {prefix} not reported"
                    )
        finally:
            engine.train(was_training)
        return metrics


@torch.no_grad()
def build_classifier(
    engine: Engine, tokenizer: Tokenizer, data: ClassificationSet, runtime: Runtime
) -> torch.Tensor:
    """[embed dim, classes]: each rank embeds ceil(C / world) classes, CLASSES_PER_BATCH at a time."""
    count, per = len(data.classnames), math.ceil(len(data.classnames) / runtime.world_size)
    mine = data.classnames[runtime.rank * per : (runtime.rank + 1) * per]
    padded = mine + [data.classnames[0]] * (per - len(mine))  # equal forwards on every rank
    embeddings = []
    for start in range(0, per, CLASSES_PER_BATCH):
        names = padded[start : start + CLASSES_PER_BATCH]
        tokens = tokenizer([p for name in names for p in data.prompts(name)]).to(runtime.device)
        features = engine.forward(None, tokens)["text_features"].float()  # normalised
        per_class = features.reshape(len(names), len(data.templates), -1).mean(dim=1)
        embeddings.append(F.normalize(per_class, dim=-1))
    local = torch.cat(embeddings)
    if runtime.world_size > 1:
        parts = [torch.empty_like(local) for _ in range(runtime.world_size)]
        dist.all_gather(parts, local.contiguous())
        local = torch.cat(parts)
    return local[:count].T.contiguous()


@torch.no_grad()
def classify(
    engine: Engine,
    classifier: torch.Tensor,
    loader: DataLoader,
    runtime: Runtime,
    *,
    normalize: ImageNormalizer,
    image_size: int,
) -> tuple[float, float, int]:
    """Top-1 and top-5 over every rank's share, with what was left out."""
    device, k = runtime.device, min(5, classifier.shape[1])
    counts = torch.zeros(6, dtype=torch.float64, device=device)  # top-1, top-5, scored, and Scored.LEFT_OUT's
    batches = iter(loader)
    while True:
        batch = next(batches, None)
        if not _any_rank_has(batch is not None, runtime):
            break
        images = batch[0] if batch is not None else _dummy(image_size)
        features = engine.forward(normalize(images), None)["image_features"].float()  # uint8 in
        if batch is None:
            continue
        labels = batch[1].to(device)
        valid = labels >= 0
        top = (100.0 * features @ classifier).topk(k, dim=1).indices[valid]
        hits = top == labels[valid].unsqueeze(1)
        left_out = [(labels == label).sum() for label in Scored.LEFT_OUT.values()]
        counts += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(), valid.sum(), *left_out]).to(
            counts.dtype
        )
    if runtime.world_size > 1:
        dist.all_reduce(counts)
    top1, top5, n, *left_out = (int(c) for c in counts.tolist())
    return Scored(top1 / max(n, 1), top5 / max(n, 1), n, dict(zip(Scored.LEFT_OUT, left_out)))


@dataclass
class Scored:
    """One set's zero-shot accuracy, over `images` scored, and the samples left out, by why."""

    LEFT_OUT: ClassVar[dict[str, int]] = {
        "unreadable images": SKIPPED,
        "samples without a .cls label or an image": UNLABELLED,
        "labels that are no class index of classnames.txt": BAD_LABEL,
    }
    top1: float
    top5: float
    images: int
    counts: dict[str, int] = field(default_factory=dict)

    def left_out(self) -> str:
        return ", ".join(f"{n} {why}" for why, n in self.counts.items() if n)


def _any_rank_has(mine: bool, runtime: Runtime) -> bool:
    if runtime.world_size == 1:
        return mine
    flag = torch.tensor([int(mine)], device=runtime.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one small collective per batch
    return bool(flag.item())


def _dummy(image_size: int) -> torch.Tensor:
    return torch.zeros(1, image_size, image_size, 3, dtype=torch.uint8)
