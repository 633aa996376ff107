"""What every config section is made of: fields carrying their CLI metadata, and the choices."""

from __future__ import annotations

import importlib.util
from dataclasses import field
from typing import Any

LOSSES = ("clip", "siglip")
LOSS_EXCHANGES = ("ring", "allgather")
OPTIMIZERS = ("adamw", "adamw8bit")
LR_SCHEDULERS = ("cosine", "const", "const-cooldown")
TOKENIZERS = ("open_clip", "hashing")  # bigclip.data.tokenizer builds them
METRIC_SINKS = ("tensorboard", "wandb")


def installed(package: str) -> bool:
    try:  # without importing it: an optional package is checked when its option is parsed
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with CLI metadata."""
    meta["help"] = help
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
