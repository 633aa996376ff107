"""The model a run's configuration describes, with its model-level options applied.

Kept apart from the model code: it reads `TrainConfig` and swaps in int8 linears from `ops`,
while `clip.py` and friends stay plain modules that know neither.
"""

from __future__ import annotations

import math

import torch

from bigclip.config import TrainConfig
from bigclip.models.clip import CLIP
from bigclip.models.registry import create_model

SIGLIP_INIT = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0}  # OpenCLIP's SigLIP init


def build_model(cfg: TrainConfig, *, device: str | torch.device = "meta") -> CLIP:
    """The model with its model-level options applied (before any engine sees it).

    On the meta device by default; an engine that must construct parameters itself (DeepSpeed
    ZeRO-3 under `deepspeed.zero.Init`) calls this again with a real device."""
    extra = SIGLIP_INIT if cfg.loss.loss == "siglip" else {}
    model = create_model(
        cfg.model.model,
        device=device,
        patch_dropout=cfg.model.force_patch_dropout,
        seed=cfg.optim.seed,
        **extra,
    )
    model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    if cfg.model.int8 != "none":
        from bigclip.ops.int8.switchback import apply_int8

        apply_int8(model, cfg.model.int8, include_attention=cfg.model.int8_attention)
    return model
