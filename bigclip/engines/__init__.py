"""Sharding engines behind one interface (`Engine`): torch FSDP2 and DeepSpeed ZeRO 1/2/3, with one
optimizer module (parameter groups, AdamW / 8-bit, clipping, loss scaling, moments).
May import models, ops, config, distributed and errors; DeepSpeed and bitsandbytes only lazily.
"""

from __future__ import annotations

from bigclip.config import TrainConfig
from bigclip.config.engine import ENGINES
from bigclip.distributed import Runtime
from bigclip.engines.base import Engine
from bigclip.errors import ConfigError
from bigclip.named_objects import import_named

__all__ = ["Engine", "build_engine", "engine_class"]


def engine_class(name: str) -> type[Engine]:
    """The Engine subclass registered as --engine `name` (config/engine.py), imported now."""
    if name not in ENGINES:
        raise ConfigError(f"--engine {name!r} is unknown; choose from {', '.join(ENGINES)}")
    return import_named(ENGINES[name])


def build_engine(cfg: TrainConfig, runtime: Runtime) -> Engine:
    """The engine named by --engine, constructed (it shards nothing until `build`)."""
    return engine_class(cfg.engine.engine)(cfg, runtime)
