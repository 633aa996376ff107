"""Sharding engines behind one interface (`Engine`): torch FSDP2 and DeepSpeed ZeRO 1/2/3, with one
optimizer module (parameter groups, AdamW / 8-bit, clipping, loss scaling, moments).
May import models, ops, config, distributed and errors; DeepSpeed and bitsandbytes only lazily.
"""

from __future__ import annotations

from bigclip.config import TrainConfig
from bigclip.distributed import Runtime
from bigclip.engines.base import Engine, StepStats

__all__ = ["Engine", "StepStats", "build_engine"]


def build_engine(cfg: TrainConfig, runtime: Runtime) -> Engine:
    """The engine named by --engine (imported lazily: DeepSpeed is heavy and optional)."""
    if cfg.engine.engine == "fsdp":
        from bigclip.engines.fsdp import FSDPEngine

        return FSDPEngine(cfg, runtime)
    if cfg.engine.engine == "deepspeed":
        from bigclip.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(cfg, runtime)
    raise ValueError(f"unknown engine {cfg.engine.engine!r}")
