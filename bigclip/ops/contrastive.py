"""Contrastive losses across the data-parallel group.

`ClipLoss` reproduces OpenCLIP's loss, including its `--local-loss` and `--gather-with-grad`
semantics: features of all ranks are all-gathered and each rank builds a local x global (or
global x global) logit matrix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from bigclip.config import LossConfig


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gather_features(
    features: torch.Tensor, *, group: dist.ProcessGroup | None, with_grad: bool, keep_local_grad: bool
) -> torch.Tensor:
    """Concatenate every rank's features in rank order.

    with_grad: gradients flow to every rank's features (all-gather backward is a reduce-scatter).
    keep_local_grad: without with_grad, put this rank's own tensor back so its gradient flows.
    """
    rank, world = _world(group)
    if world == 1:
        return features
    if with_grad:
        return torch.cat(dist_fn.all_gather(features, group=group), dim=0)
    gathered = [torch.empty_like(features) for _ in range(world)]
    dist.all_gather(gathered, features.detach().contiguous(), group=group)
    if keep_local_grad:
        gathered[rank] = features
    return torch.cat(gathered, dim=0)


class ClipLoss(nn.Module):
    """OpenCLIP's ClipLoss: mean of image->text and text->image cross-entropy."""

    def __init__(
        self,
        *,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.group = group

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rank, world = _world(self.group)
        image_features, text_features = image_features.float(), text_features.float()
        logit_scale = logit_scale.float()
        kwargs = dict(group=self.group, with_grad=self.gather_with_grad, keep_local_grad=not self.local_loss)
        all_image = gather_features(image_features, **kwargs)
        all_text = gather_features(text_features, **kwargs)
        n = image_features.shape[0]
        if self.local_loss:
            logits_per_image = logit_scale * image_features @ all_text.T
            logits_per_text = logit_scale * text_features @ all_image.T
            labels = torch.arange(n, device=image_features.device) + n * rank
        else:
            logits_per_image = logit_scale * all_image @ all_text.T
            logits_per_text = logits_per_image.T
            labels = torch.arange(all_image.shape[0], device=image_features.device)
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def build_loss(cfg: LossConfig, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """The loss module for a run's LossConfig."""
    if cfg.loss == "clip" and cfg.loss_chunk_size == 0:
        return ClipLoss(local_loss=cfg.local_loss, gather_with_grad=cfg.gather_with_grad, group=group)
    raise NotImplementedError(f"--loss {cfg.loss} with --loss-chunk-size {cfg.loss_chunk_size}")
