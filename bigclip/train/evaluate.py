"""Evaluation as OpenCLIP's trainer runs it (`open_clip_train/train.py` `evaluate`), when it runs
(`val_due`: --val-frequency; zeroshot.py: --zeroshot-frequency) and where it is reported.

Held-out retrieval on --val-data gives OpenCLIP's `get_clip_metrics` (R@1/5/10, mean and median
rank, image->text and text->image) and its `clip_val_loss`; zero-shot classification is zeroshot.py.
The trainer (trainer.py `evaluate`) runs them and reports the results: the log (OpenCLIP's `Eval
Epoch:` line), the metric sinks under `val/` and one JSON line per evaluation in
LOGS/NAME/results.jsonl, under OpenCLIP's names, plus bigclip's `step` and `chance`.

Sample i's image matches caption i. Every rank embeds the samples with index = rank (mod world
size); ranks pad to the same number of samples because a sharded model needs every rank in
every forward. Features are gathered and scored on all ranks (identical results).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bigclip.config import DataConfig, TrainConfig
from bigclip.data.decode import SampleKeys
from bigclip.data.device import ImageNormalizer
from bigclip.data.eval import EvalSample, iter_eval_samples
from bigclip.data.tokenizer import Tokenizer
from bigclip.distributed import Runtime
from bigclip.engines import Engine
from bigclip.errors import DataError

RECALL_AT = (1, 5, 10)  # OpenCLIP's get_clip_metrics


def val_due(cfg: TrainConfig, epoch: int) -> bool:
    """OpenCLIP's --val-frequency: after every Nth completed epoch and after the last one."""
    every = cfg.data.val_frequency
    return bool(every) and (epoch % every == 0 or epoch == cfg.optim.epochs)


def retrieval_metrics(
    image_features: torch.Tensor, text_features: torch.Tensor, *, logit_scale: float, batch_size: int,
    chunk_size: int = 4096, fp32: bool = True,
) -> dict[str, float]:  # fmt: skip
    """OpenCLIP's retrieval metrics and clip_val_loss for L2-normalised, index-aligned features;
    chance (R@1 of a random ranking) is 1/N. OpenCLIP main's --val-retrieval-chunk-size: scores
    `chunk_size` rows at a time (0: the whole N x N matrix at once), exact either way;
    --val-retrieval-precision: fp32 or the features' dtype."""
    if fp32:
        image_features, text_features = image_features.float(), text_features.float()
    metrics: dict[str, float] = {}
    for name, queries, keys in (("image_to_text", image_features, text_features),
                                ("text_to_image", text_features, image_features)):  # fmt: skip
        metrics |= rank_metrics(name, truth_ranks(queries, keys, chunk_size=chunk_size))
    n = image_features.shape[0]
    loss = clip_val_loss(image_features, text_features, logit_scale=logit_scale, batch_size=batch_size)
    return metrics | {"clip_val_loss": loss, "num_samples": n, "chance": 1.0 / n}


def truth_ranks(queries: torch.Tensor, keys: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
    """For each query row i, the 0-based place of key i among its scores, best first: how many keys
    score higher, plus those that tie at a lower index (argmax's order, so R@1 is argmax == i).
    OpenCLIP's argsort orders ties arbitrarily; the logit scale, a positive factor, changes no rank."""
    step = chunk_size if chunk_size > 0 else max(1, queries.shape[0])
    index = torch.arange(keys.shape[0], device=keys.device)
    ranks = []
    for start in range(0, queries.shape[0], step):
        scores = queries[start : start + step] @ keys.T
        own_index = torch.arange(start, start + scores.shape[0], device=keys.device)
        own = scores.gather(1, own_index.unsqueeze(1))
        ahead = (scores > own) | ((scores == own) & (index.unsqueeze(0) < own_index.unsqueeze(1)))
        ranks.append(ahead.sum(dim=1))
    return torch.cat(ranks)


def rank_metrics(name: str, ranks: torch.Tensor) -> dict[str, float]:
    """OpenCLIP's names and formulas: mean rank and floor(median) rank, 1-based; R@k."""
    places = ranks.cpu().numpy()
    metrics = {
        f"{name}_mean_rank": float(places.mean() + 1),
        f"{name}_median_rank": float(np.floor(np.median(places)) + 1),
    }
    return metrics | {f"{name}_R@{k}": float(np.mean(places < k)) for k in RECALL_AT}


def clip_val_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, *, logit_scale: float, batch_size: int
) -> float:
    """OpenCLIP's clip_val_loss: the symmetric CLIP loss within each batch of its validation loader
    (`batch_size` consecutive samples, the last one partial), averaged over samples. It depends on
    the batch size, as OpenCLIP's does (a batch of B has chance loss log B)."""
    total = 0.0
    for image, text in zip(image_features.split(batch_size), text_features.split(batch_size)):
        logits = logit_scale * image.float() @ text.float().T
        labels = torch.arange(logits.shape[0], device=logits.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        total += loss.item() * logits.shape[0]
    return total / max(image_features.shape[0], 1)


@torch.no_grad()
def _embed(
    engine: Engine, share: list, *, batch_size: int, device: torch.device, normalize: ImageNormalizer
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """This rank's image and text features, and the model's logit scale (exponentiated)."""
    images, texts, scale = [], [], 0.0
    for start in range(0, len(share), batch_size):
        chunk = share[start : start + batch_size]
        out = engine.forward(
            normalize(torch.stack([s.image for s in chunk])),  # uint8 -> normalised on the device
            torch.stack([s.tokens for s in chunk]).to(device),
        )
        images.append(out["image_features"].float())
        texts.append(out["text_features"].float())
        scale = float(out["logit_scale"].float().mean())  # replicated: the same on every rank and batch
    return torch.cat(images), torch.cat(texts), scale


def _gather_in_order(local: torch.Tensor, *, world: int, total: int) -> torch.Tensor:
    """Undo the round-robin split: row j of rank r is sample j * world + r."""
    if world == 1:
        return local[:total]
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    interleaved = torch.stack(parts, dim=1).reshape(-1, local.shape[-1])
    return interleaved[:total]


def held_out_retrieval(
    engine: Engine,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    runtime: Runtime,
    *,
    normalize: ImageNormalizer,
    image_size: int,
) -> dict[str, float]:
    """Retrieval metrics on --val-data. This rank reads its share of the pairs, indices rank,
    rank + world, ... in order, with the exact eval transform (resize + center crop, as OpenCLIP);
    `normalize` puts their uint8 images on the device, as the training loader does
    (`image_normalizer` in bigclip.data.device). --batch-size (per rank) sets the forwards and
    clip_val_loss's batches."""
    mine = iter_eval_samples(
        cfg.val_data, image_size=image_size, tokenizer=tokenizer, limit=cfg.val_num_samples,
        rank=runtime.rank, world_size=runtime.world_size,
        resize_mode=cfg.image_resize_mode, interpolation=cfg.image_interpolation,
        keys=SampleKeys.parse(image_key=cfg.image_key, text_key=cfg.text_key),
    )  # fmt: skip
    share, total = _padded_share(list(mine), runtime)
    was_training = engine.module.training
    engine.eval()
    image_local, text_local, scale = _embed(
        engine, share, batch_size=cfg.batch_size, device=runtime.device, normalize=normalize
    )
    engine.train(was_training)
    image = _gather_in_order(image_local, world=runtime.world_size, total=total)
    text = _gather_in_order(text_local, world=runtime.world_size, total=total)
    return retrieval_metrics(
        image, text, logit_scale=scale, batch_size=cfg.batch_size,
        chunk_size=cfg.val_retrieval_chunk_size, fp32=cfg.val_retrieval_precision == "fp32",
    )  # fmt: skip


def _padded_share(mine: list[EvalSample], runtime: Runtime) -> tuple[list[EvalSample], int]:
    """Pad every rank to the same count (a sharded model needs all ranks in every forward)."""
    counts = torch.tensor([len(mine)], dtype=torch.long)
    if runtime.world_size > 1:
        gathered = [torch.zeros_like(counts) for _ in range(runtime.world_size)]
        dist.all_gather(gathered, counts)
        counts = torch.cat(gathered)
    if int(counts.min()) == 0:  # decided on gathered counts, so every rank raises together
        raise DataError(
            f"--val-data yielded {int(counts.sum())} readable samples for {runtime.world_size} ranks; "
            "evaluation needs at least one per rank"
        )
    per_rank, total = int(counts.max()), int(counts.sum())
    return mine + [mine[0]] * (per_rank - len(mine)), total
