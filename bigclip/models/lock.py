"""Locked towers (LiT, arXiv:2111.07991) with OpenCLIP's meanings: freeze a tower, optionally
leaving its last N layer groups trainable.

Groups, first to last, as OpenCLIP's `VisionTransformer.lock` and `lock_text_tower` cut them:
  image  [conv1, class_embedding, positional_embedding, ln_pre], block 0, ..., block L-2,
         [block L-1, ln_post], proj
  text   [token_embedding, positional_embedding], block 0, ..., block L-2,
         [block L-1, ln_final], text_projection
Freezing is `requires_grad = False` on the plain model, before any engine sees it: engines
leave frozen parameters out of the optimizer (no moments, no master copy to update).

`--lock-text-freeze-layer-norm` follows OpenCLIP's text towers that implement it (the
Hugging Face one): without it the LayerNorms of locked layers stay trainable, with it they
freeze too. (OpenCLIP's own CLIP class accepts only the frozen form and asserts otherwise.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from bigclip.config import ModelConfig
    from bigclip.models.clip import CLIP

Group = list[nn.Module | nn.Parameter]


def image_groups(model: CLIP) -> list[Group]:
    v = model.visual
    blocks = list(v.transformer.resblocks)
    head = [v.conv1, v.class_embedding, v.positional_embedding, v.ln_pre]
    return [head, *([b] for b in blocks[:-1]), [blocks[-1], v.ln_post], [v.proj]]


def text_groups(model: CLIP) -> list[Group]:
    blocks = list(model.transformer.resblocks)
    head = [model.token_embedding, model.positional_embedding]
    return [head, *([b] for b in blocks[:-1]), [blocks[-1], model.ln_final], [model.text_projection]]


def _params(group: Iterable[nn.Module | nn.Parameter]) -> Iterable[nn.Parameter]:
    for item in group:
        yield from [item] if isinstance(item, nn.Parameter) else item.parameters()


def _lock(groups: list[Group], unlocked: int) -> list[Group]:
    """Freeze every group but the last `unlocked`; returns the frozen groups."""
    frozen = groups[: max(0, len(groups) - unlocked)]
    for p in _params(item for group in groups for item in group):
        p.requires_grad_(False)
    for p in _params(item for group in groups[len(frozen) :] for item in group):
        p.requires_grad_(True)
    return frozen


def lock_image_tower(model: CLIP, *, unlocked_groups: int = 0) -> None:
    _lock(image_groups(model), unlocked_groups)


def lock_text_tower(model: CLIP, *, unlocked_layers: int = 0, freeze_layer_norm: bool = False) -> None:
    frozen = _lock(text_groups(model), unlocked_layers)
    if freeze_layer_norm:
        return
    modules = [item for group in frozen for item in group if isinstance(item, nn.Module)]
    for norm in (m for module in modules for m in module.modules() if isinstance(m, nn.LayerNorm)):
        norm.requires_grad_(True)


def apply_locks(model: CLIP, cfg: ModelConfig) -> None:
    """The run's --lock-* options on a (meta-device or real) model."""
    if cfg.lock_image:
        lock_image_tower(model, unlocked_groups=cfg.lock_image_unlocked_groups)
    if cfg.lock_text:
        lock_text_tower(
            model,
            unlocked_layers=cfg.lock_text_unlocked_layers,
            freeze_layer_norm=cfg.lock_text_freeze_layer_norm,
        )
