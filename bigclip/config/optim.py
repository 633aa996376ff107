"""The optimizer, its learning-rate schedule and the step budget."""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.config.fields import LR_SCHEDULERS, OPTIMIZERS, opt
from bigclip.errors import ConfigError

SEED_MAX = 2**31 - 1  # numpy takes seeds up to 2**32 - 1, and each rank adds its rank


@dataclass
class OptimConfig:
    optimizer: str = opt("adamw", "Optimizer: torch AdamW or bitsandbytes' 8-bit AdamW.", choices=OPTIMIZERS)
    opt_kwargs: dict = opt(
        {},
        "Extra optimizer keyword arguments, KEY=VALUE words (OpenCLIP main's --opt-kwargs), e.g. "
        "--opt-kwargs amsgrad=True; --lr, --beta1/2, --eps and --wd keep their own flags.",
    )
    lr: float = opt(5e-4, "Peak learning rate.")
    beta1: float = opt(0.9, "Adam beta1.")
    beta2: float = opt(0.98, "Adam beta2.")
    eps: float = opt(1e-6, "Adam epsilon.")
    wd: float = opt(0.2, "Weight decay (not applied to gains, biases, 1-d embeddings, logit scale/bias).")
    warmup: int = opt(10000, "Linear warmup steps.")
    epochs: int = opt(32, "Epochs to train.")
    max_steps: int = opt(0, "Stop after this many optimizer steps in total (0: run all epochs).")
    lr_scheduler: str = opt("cosine", "LR schedule after warmup.", choices=LR_SCHEDULERS)
    epochs_cooldown: int = opt(0, "const-cooldown: decay over the last N epochs (OpenCLIP semantics).")
    lr_cooldown_end: float = opt(0.0, "const-cooldown: learning rate at the end of the cooldown.")
    lr_cooldown_power: float = opt(1.0, "const-cooldown: decay power (1: linear).")
    skip_scheduler: bool = opt(False, "Keep --lr constant from the first step (no warmup, no decay).")
    grad_clip_norm: float = opt(0.0, "Clip the global gradient norm to this value (0: off).")
    accum_freq: int = opt(1, "Micro-batches per optimizer step (features cached, OpenCLIP semantics).")
    seed: int = opt(0, "Random seed (weights, data order, patch dropout).")

    def validate(self) -> None:
        own = {"lr", "betas", "eps", "weight_decay"} & set(self.opt_kwargs)
        if own:
            raise ConfigError(
                f"--opt-kwargs {', '.join(sorted(own))}: set these with their own flags (--lr, --beta1/--beta2, "
                "--eps, --wd), which the learning-rate schedule and the weight-decay groups read"
            )
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1) or self.eps <= 0:
            raise ConfigError(
                f"--beta1 {self.beta1}, --beta2 {self.beta2}, --eps {self.eps}: Adam needs betas in [0, 1) "
                "and eps > 0 (defaults 0.9, 0.98, 1e-6)"
            )
        if not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(f"--seed must be between 0 and {SEED_MAX} (each rank seeds numpy with --seed + its "
                              f"rank), got {self.seed}")  # fmt: skip
        if self.accum_freq < 1:
            raise ConfigError(f"--accum-freq must be at least 1, got {self.accum_freq}")
        if self.epochs < 0 or self.max_steps < 0:
            raise ConfigError(f"--epochs and --max-steps must not be negative (0: no limit from it), got "
                              f"{self.epochs} and {self.max_steps}")  # fmt: skip
        if self.epochs < 1 and self.max_steps < 1:
            raise ConfigError("set --epochs or --max-steps to at least 1")
        if self.warmup < 0 or self.wd < 0 or self.grad_clip_norm < 0:
            raise ConfigError("--warmup, --wd and --grad-clip-norm must not be negative")
        if self.lr_scheduler == "const-cooldown" and self.epochs_cooldown < 1:
            raise ConfigError(
                "--lr-scheduler const-cooldown needs --epochs-cooldown N (epochs of decay at the end)"
            )
        if self.epochs_cooldown < 0 or self.lr_cooldown_end < 0 or self.lr_cooldown_power <= 0:
            raise ConfigError(
                "--epochs-cooldown and --lr-cooldown-end must not be negative, --lr-cooldown-power > 0"
            )
