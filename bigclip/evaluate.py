"""Zero-shot retrieval on held-out image-caption pairs: top-1 image->text and text->image.

Sample i's image matches caption i. Every rank embeds the samples with index = rank (mod world
size); ranks pad to the same number of batches because a sharded model needs every rank in
every forward. Features are gathered and scored on all ranks (identical results).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from bigclip.distributed import Runtime
from bigclip.engines import Engine


def retrieval_top1(image_features: torch.Tensor, text_features: torch.Tensor) -> dict[str, float]:
    """Top-1 accuracy both ways for L2-normalised, index-aligned features; chance is 1/N."""
    logits = image_features.float() @ text_features.float().T
    truth = torch.arange(logits.shape[0], device=logits.device)
    return {
        "image_to_text_R@1": (logits.argmax(dim=1) == truth).float().mean().item(),
        "text_to_image_R@1": (logits.argmax(dim=0) == truth).float().mean().item(),
        "num_samples": logits.shape[0],
        "chance": 1.0 / logits.shape[0],
    }


def _my_share(samples: list[tuple[torch.Tensor, torch.Tensor]], rank: int, world: int) -> list:
    mine = samples[rank::world]
    per_rank = -(-len(samples) // world)
    return mine + [samples[0]] * (per_rank - len(mine))  # padding, dropped after the gather


@torch.no_grad()
def _embed(
    engine: Engine, share: list, *, batch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    images, texts = [], []
    for start in range(0, len(share), batch_size):
        chunk = share[start : start + batch_size]
        out = engine.forward(
            torch.stack([s[0] for s in chunk]).to(device), torch.stack([s[1] for s in chunk]).to(device)
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
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]],
    runtime: Runtime,
    *,
    batch_size: int = 64,
) -> dict[str, float]:
    """`samples`: (image, token ids) pairs in a fixed order, identical on every rank."""
    samples = list(samples)
    was_training = engine.module.training
    engine.eval()
    share = _my_share(samples, runtime.rank, runtime.world_size)
    image_local, text_local = _embed(engine, share, batch_size=batch_size, device=runtime.device)
    engine.train(was_training)
    image = _gather_in_order(image_local, world=runtime.world_size, total=len(samples))
    text = _gather_in_order(text_local, world=runtime.world_size, total=len(samples))
    return retrieval_top1(image, text)
