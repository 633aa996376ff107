"""Model configs (OpenCLIP's JSON schema) and the `create_model` factory (`bigclip models` lists them:
listing.py); `build_clip`, the CLIP family's builder (clip_family.py names it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bigclip.models.clip import CLIP, init_weights
from bigclip.models.clip_family import SIGLIP_INIT
from bigclip.models.lock import apply_locks
from bigclip.models.named_configs import get_model_config
from bigclip.models.shape import ModelOptions

if TYPE_CHECKING:
    from bigclip.config import ModelConfig

__all__ = ["build_clip", "count_parameters", "create_model", "get_model_config"]


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


def build_clip(model: ModelConfig, options: ModelOptions, *, device: torch.device | str, seed: int) -> CLIP:
    """The run's CLIP: its --force-* options, SigLIP's logit-bias init, checkpointing and locks."""
    clip = create_model(
        model.model, device=device, patch_dropout=options.patch_dropout, seed=seed, cache_dir=options.cache_dir,
        force_quick_gelu=options.quick_gelu, force_image_size=options.image_size,
        force_context_length=options.context_length, **(SIGLIP_INIT if options.loss == "siglip" else {}),
    )  # fmt: skip
    clip.set_grad_checkpointing(
        model.grad_checkpointing, every=model.grad_checkpointing_every, policy=model.grad_checkpointing_policy
    )
    apply_locks(clip, model)
    return clip


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts in OpenCLIP's split: total, image tower, text tower (the rest)."""
    total = sum(p.numel() for p in model.parameters())
    image = sum(p.numel() for p in model.visual.parameters())
    return {"total": total, "image": image, "text": total - image}
