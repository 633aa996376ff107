"""A run's model options (`ModelOptions`: what changes what its --model name builds) and image
size, read from its configuration through the model's family. No torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bigclip.models.families import model_shape
from bigclip.models.shape import ModelOptions

if TYPE_CHECKING:
    from bigclip.config import TrainConfig


def model_options(cfg: TrainConfig) -> ModelOptions:
    """A training configuration's model options (its --force-* flags, loss and cache)."""
    m = cfg.model
    return ModelOptions(
        patch_dropout=m.force_patch_dropout,
        image_size=m.force_image_size[0] if m.force_image_size else 0,
        context_length=m.force_context_length,
        quick_gelu=m.force_quick_gelu,
        loss=cfg.loss.loss,
        cache_dir=m.cache_dir,
    )


def image_size(cfg: TrainConfig) -> int:
    """The side of the images this run's model takes (its --force-image-size applied)."""
    return model_shape(cfg.model.model, model_options(cfg)).image_size
