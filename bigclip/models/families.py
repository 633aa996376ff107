"""Which model family a `--model` name belongs to, and its static shape: the entry through which the
planner and consolidation see a model (models/shape.py says what a shape holds). No torch.

CLIP (clip_family.py) is built in; another family joins with `register_family` (docs/extending.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bigclip.errors import ConfigError
from bigclip.models.clip_family import CLIP_FAMILY
from bigclip.models.shape import ModelFamily, ModelOptions, ModelShape

if TYPE_CHECKING:
    from bigclip.config import TrainConfig

FAMILIES: list[ModelFamily] = [CLIP_FAMILY]


def register_family(family: ModelFamily) -> None:
    """Add a family (or replace the one of the same name); names are looked up in registration order."""
    FAMILIES[:] = [f for f in FAMILIES if f.name != family.name] + [family]


def family_of(name: str) -> ModelFamily:
    for family in FAMILIES:
        if family.owns(name):
            return family
    names = sorted((n for f in FAMILIES for n in f.configs()), key=str.lower)
    others = "".join(f", or {f.other_names}" for f in FAMILIES if f.other_names)
    raise ConfigError(f"unknown model {name!r}; available: {', '.join(names)}{others}")


def model_shape(name: str, options: ModelOptions | None = None) -> ModelShape:
    """The shape of the model `name` builds with these options (ConfigError for an unknown name)."""
    return family_of(name).shape(name, options or ModelOptions())


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
