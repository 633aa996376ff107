"""The learning-rate schedule, step by step, as OpenCLIP's `open_clip_train.scheduler`.

  cosine          linear warmup to --lr, then half a cosine to 0 at the last step
  const           linear warmup, then --lr
  const-cooldown  linear warmup, --lr, then over the last --epochs-cooldown epochs a decay
                  (1 - progress) ** --lr-cooldown-power from --lr to --lr-cooldown-end
  --skip-scheduler  --lr from the first step to the last (OpenCLIP never calls the scheduler)

Steps are optimizer steps (OpenCLIP's `i // accum_freq`); warmup wins over cooldown, as there.
The schedule is a pure function of the step, so a resumed run continues it exactly.
"""

from __future__ import annotations

import math

from bigclip.config import OptimConfig


def cooldown_steps(cfg: OptimConfig, *, steps_per_epoch: int) -> int:
    return steps_per_epoch * cfg.epochs_cooldown if cfg.lr_scheduler == "const-cooldown" else 0


def lr_at(step: int, cfg: OptimConfig, total_steps: int, *, steps_per_epoch: int = 0) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if cfg.skip_scheduler:
        return cfg.lr
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_scheduler == "const":
        return cfg.lr
    if cfg.lr_scheduler == "const-cooldown":
        return _cooldown(step, cfg, total_steps, cooldown_steps(cfg, steps_per_epoch=steps_per_epoch))
    decay_steps = max(1, total_steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / decay_steps)
    return 0.5 * (1 + math.cos(math.pi * progress)) * cfg.lr


def _cooldown(step: int, cfg: OptimConfig, total_steps: int, cooldown: int) -> float:
    start = total_steps - cooldown
    if step < start:
        return cfg.lr
    progress = min(1.0, (step - start) / max(1, cooldown))  # clamped: past the end stays at the end value
    decay = (1 - progress) ** cfg.lr_cooldown_power
    return decay * (cfg.lr - cfg.lr_cooldown_end) + cfg.lr_cooldown_end
