"""Model configs (OpenCLIP's JSON schema) and the `create_model` factory (`bigclip models` lists them:
listing.py)."""

from __future__ import annotations

import torch

from bigclip.models.clip import CLIP, init_weights
from bigclip.models.named_configs import get_model_config, list_models

__all__ = ["count_parameters", "create_model", "get_model_config", "list_models"]


def create_model(
    name: str,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
    patch_dropout: float = 0.0,
    init_logit_bias: float | None = None,
    init_logit_scale: float | None = None,
    seed: int = 0,
    cache_dir: str = "",
    **forced: int | bool,
) -> CLIP:
    """Build a CLIP by config name.

    On the meta device nothing is allocated (ViT-bigG-14 builds in well under a second) and
    weights are left for the engine to initialise after sharding. On a real device the
    weights are initialised here with `init_weights(seed=seed)`. `forced`: `get_model_config`'s
    force_* overrides.
    """
    cfg = get_model_config(name, cache_dir=cache_dir, **forced)  # and force_quick_gelu, _image_size, ...
    if init_logit_bias is not None:
        cfg.init_logit_bias = init_logit_bias
    if init_logit_scale is not None:
        cfg.init_logit_scale = init_logit_scale
    model = CLIP(cfg, patch_dropout=patch_dropout, device=device)
    if torch.device(device).type != "meta":
        init_weights(model, seed=seed)
    if dtype is not None:
        model.to(dtype)
    return model


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts in OpenCLIP's split: total, image tower, text tower (the rest)."""
    total = sum(p.numel() for p in model.parameters())
    image = sum(p.numel() for p in model.visual.parameters())
    return {"total": total, "image": image, "text": total - image}
