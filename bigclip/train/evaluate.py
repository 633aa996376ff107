"""Zero-shot retrieval on held-out image-caption pairs: top-1 image->text and text->image, and
when to run it (`val_due`, OpenCLIP's --val-frequency).

Sample i's image matches caption i. Every rank embeds the samples with index = rank (mod world
size); ranks pad to the same number of samples because a sharded model needs every rank in
every forward. Features are gathered and scored on all ranks (identical results).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from bigclip import data
from bigclip.config import DataConfig, TrainConfig
from bigclip.data import EvalSample, ImageNormalizer, Tokenizer
from bigclip.distributed import Runtime
from bigclip.engines import Engine
from bigclip.errors import DataError


def val_due(cfg: TrainConfig, epoch: int) -> bool:
    """OpenCLIP's --val-frequency: after every Nth completed epoch and after the last one."""
    every = cfg.data.val_frequency
    return bool(every) and (epoch % every == 0 or epoch == cfg.optim.epochs)


def retrieval_top1(
    image_features: torch.Tensor, text_features: torch.Tensor, *, chunk_size: int = 4096, fp32: bool = True
) -> dict[str, float]:
    """Top-1 accuracy both ways for L2-normalised, index-aligned features; chance is 1/N.
    OpenCLIP main's --val-retrieval-chunk-size: scores `chunk_size` rows at a time (0: the whole
    N x N matrix at once), exact either way; --val-retrieval-precision: fp32 or the features' dtype."""
    if fp32:
        image_features, text_features = image_features.float(), text_features.float()
    n = image_features.shape[0]
    truth = torch.arange(n, device=image_features.device)
    return {
        "image_to_text_R@1": (_best_match(image_features, text_features, chunk_size) == truth)
        .float()
        .mean()
        .item(),
        "text_to_image_R@1": (_best_match(text_features, image_features, chunk_size) == truth)
        .float()
        .mean()
        .item(),
        "num_samples": n,
        "chance": 1.0 / n,
    }


def _best_match(queries: torch.Tensor, keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """For each query row, the index of its highest-scoring key (the first one on a tie, as argmax)."""
    step = chunk_size if chunk_size > 0 else max(1, queries.shape[0])
    return torch.cat([(part @ keys.T).argmax(dim=1) for part in queries.split(step)])


@torch.no_grad()
def _embed(
    engine: Engine, share: list, *, batch_size: int, device: torch.device, normalize: ImageNormalizer
) -> tuple[torch.Tensor, torch.Tensor]:
    images, texts = [], []
    for start in range(0, len(share), batch_size):
        chunk = share[start : start + batch_size]
        out = engine.forward(
            normalize(torch.stack([s.image for s in chunk])),  # uint8 -> normalised on the device
            torch.stack([s.tokens for s in chunk]).to(device),
        )
        images.append(out["image_features"].float())
        texts.append(out["text_features"].float())
    return torch.cat(images), torch.cat(texts)


def _gather_in_order(local: torch.Tensor, *, world: int, total: int) -> torch.Tensor:
    """Undo the round-robin split: row j of rank r is sample j * world + r."""
    if world == 1:
        return local[:total]
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    interleaved = torch.stack(parts, dim=1).reshape(-1, local.shape[-1])
    return interleaved[:total]


def evaluate_retrieval(
    engine: Engine,
    my_samples: Sequence[EvalSample],
    runtime: Runtime,
    *,
    normalize: ImageNormalizer,
    batch_size: int = 64,
    chunk_size: int = 4096,
    fp32: bool = True,
) -> dict[str, float]:
    """`my_samples`: this rank's share of the held-out set, indices rank, rank + world, ... in order
    (as `bigclip.data.iter_eval_samples(..., rank=, world_size=)` yields them); `normalize` puts
    their uint8 images on the device, as the training loader does (`data.image_normalizer`)."""
    share, total = _padded_share(list(my_samples), runtime)
    was_training = engine.module.training
    engine.eval()
    image_local, text_local = _embed(
        engine, share, batch_size=batch_size, device=runtime.device, normalize=normalize
    )
    engine.train(was_training)
    image = _gather_in_order(image_local, world=runtime.world_size, total=total)
    text = _gather_in_order(text_local, world=runtime.world_size, total=total)
    return retrieval_top1(image, text, chunk_size=chunk_size, fp32=fp32)


def held_out_retrieval(
    engine: Engine,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    runtime: Runtime,
    *,
    normalize: ImageNormalizer,
) -> dict[str, float]:
    """evaluate_retrieval on --val-data: this rank's share of the pairs, read with the exact eval
    transform (resize + center crop, as OpenCLIP)."""
    mine = data.iter_eval_samples(
        cfg.val_data, image_size=engine.unwrapped().image_size, tokenizer=tokenizer, limit=cfg.val_num_samples,
        rank=runtime.rank, world_size=runtime.world_size,
        resize_mode=cfg.image_resize_mode, interpolation=cfg.image_interpolation,
        keys=data.SampleKeys.parse(image_key=cfg.image_key, text_key=cfg.text_key),
    )  # fmt: skip
    return evaluate_retrieval(
        engine, list(mine), runtime, normalize=normalize, batch_size=cfg.batch_size,
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
