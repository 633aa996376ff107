"""Pieces every engine shares: precision policy, parameter groups, optimizers, loss scaling."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from bigclip.config import OptimConfig
from bigclip.errors import ConfigError


@dataclass(frozen=True)
class Precision:
    """What a `--precision` value means for parameters, compute and gradient reduction."""

    name: str
    compute_dtype: torch.dtype  # dtype the residual blocks run in
    param_dtype: torch.dtype  # dtype of the stored (sharded) parameters and optimizer master copy
    reduce_dtype: torch.dtype  # dtype gradients are reduced in
    loss_scaling: bool  # fp16 needs dynamic loss scaling

    @classmethod
    def from_name(cls, name: str) -> Precision:
        table = {
            "fp32": cls(name, torch.float32, torch.float32, torch.float32, False),
            "amp_bf16": cls(name, torch.bfloat16, torch.float32, torch.float32, False),
            "amp": cls(name, torch.float16, torch.float32, torch.float32, True),
            "pure_bf16": cls(name, torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
        }
        if name not in table:
            raise ConfigError(f"unknown --precision {name!r}; choose from {sorted(table)}")
        return table[name]

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype


def excluded_from_weight_decay(name: str, param: nn.Parameter) -> bool:
    """OpenCLIP's rule: gains, biases, 1-d embeddings and the logit scale/bias get no weight decay."""
    ndim = len(getattr(param, "ds_shape", param.shape))  # ZeRO-3 parameters are empty outside forward
    return ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if excluded_from_weight_decay(name, param) else decay).append(param)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def make_optimizer(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, **kwargs)
    if cfg.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ConfigError("--optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes") from e
        return bnb.optim.AdamW8bit(groups, **kwargs)
    raise ConfigError(f"unknown --optimizer {cfg.optimizer!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_by_total_norm_(
    local_grads: Iterable[torch.Tensor], total_norm: torch.Tensor, max_norm: float
) -> None:
    """Scale gradients (local shards, plain tensors) so their global norm is at most max_norm.

    No host sync: the coefficient stays a device tensor, as in torch's clip_grad_norm_."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in local_grads:
        g.mul_(coef.to(g.dtype))


class DynamicLossScaler:
    """fp16 loss scaling: halve the scale on overflow (and skip the step), double it after
    `growth_interval` clean steps. Engine-agnostic: it only scales the loss and inspects the
    gradient norm the engine computes anyway for clipping."""

    def __init__(self, *, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._clean_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def update(self, *, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps % self.growth_interval == 0:
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = float(state["scale"]), int(state["clean_steps"])


def is_finite(norm: torch.Tensor) -> bool:
    return math.isfinite(float(norm))
