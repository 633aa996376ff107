"""Which model family a `--model` name belongs to, and its static shape: the entry through which a
run checks, builds and tokenizes for its model, and the planner and consolidation see it
(models/shape.py says what a family and a shape hold). No torch.

CLIP (clip_family.py) is built in; another family joins with `register_family` (docs/extending.md).
"""

from __future__ import annotations

from bigclip.errors import ConfigError
from bigclip.models.clip_family import CLIP_FAMILY
from bigclip.models.shape import ModelFamily, ModelOptions, ModelShape

FAMILIES: list[ModelFamily] = [CLIP_FAMILY]


def register_family(family: ModelFamily) -> None:
    """Add a family (or replace the one of the same name); names are looked up in registration order."""
    FAMILIES[:] = [f for f in FAMILIES if f.name != family.name] + [family]


def family_of(name: str, *, pretrained: str = "") -> ModelFamily:
    """The family that owns --model `name`; for none, a ConfigError listing the names there are
    (and, given the run's --pretrained, what the families make of it: a tag of other models)."""
    for family in FAMILIES:
        if family.owns(name):
            return family
    names = sorted(all_configs(), key=str.lower)
    others = "".join(f", or {f.other_names}" for f in FAMILIES if f.other_names)
    hints = "".join(f.pretrained_hint(pretrained) for f in FAMILIES) if pretrained else ""
    raise ConfigError(f"unknown model {name!r}; available: {', '.join(names)}{others}{hints}")


def all_configs() -> list[str]:
    """Every registered family's config names, family by family (`bigclip models`)."""
    return [name for family in FAMILIES for name in family.configs()]


def model_shape(name: str, options: ModelOptions | None = None) -> ModelShape:
    """The shape of the model `name` builds with these options (ConfigError for an unknown name)."""
    return family_of(name).shape(name, options or ModelOptions())
