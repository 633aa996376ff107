"""Pieces every engine shares: precision policy, parameter groups, optimizers, loss scaling,
and optimizer state read and written as fp32 Adam moments whatever the optimizer stores."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bigclip.config import PRECISION_KINDS, OptimConfig
from bigclip.errors import ConfigError

if TYPE_CHECKING:
    from bigclip.engines.master_weights import MasterWeights


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
        """The torch dtypes of config/precisions.py's entry."""
        if name not in PRECISION_KINDS:
            raise ConfigError(f"unknown --precision {name!r}; choose from {', '.join(PRECISION_KINDS)}")
        kind = PRECISION_KINDS[name]
        dtypes = (getattr(torch, d) for d in (kind.compute, kind.params, kind.reduce))
        return cls(name, *dtypes, kind.loss_scaling)

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype


T = TypeVar("T")


def excluded_from_weight_decay(name: str, shape: Sequence[int]) -> bool:
    """OpenCLIP's rule: gains, biases, 1-d embeddings and the logit scale/bias get no weight decay."""
    return len(shape) < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def weight_decay_split(items: Iterable[tuple[str, Sequence[int], T]]) -> tuple[list[T], list[T]]:
    """Each (name, shape, value)'s value in bigclip's (and OpenCLIP's) two optimizer groups, in
    order: (no weight decay, weight decay)."""
    no_decay: list[T] = []
    decay: list[T] = []
    for name, shape, value in items:
        (no_decay if excluded_from_weight_decay(name, shape) else decay).append(value)
    return no_decay, decay


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    no_decay, decay = weight_decay_split(
        (name, getattr(param, "ds_shape", param.shape), param)  # ZeRO-3 parameters are empty outside forward
        for name, param in model.named_parameters()
        if param.requires_grad
    )
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


FUSED_ADAMW_DEVICES = ("cuda", "cpu")  # device types bigclip runs on that have torch's fused AdamW


def fusable(groups: list[dict]) -> bool:
    """torch's fused AdamW takes floating-point parameters on a device with its kernel (not meta)."""
    params = [p for g in groups for p in g["params"]]
    return all(p.device.type in FUSED_ADAMW_DEVICES and torch.is_floating_point(p) for p in params)


def make_optimizer(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """--optimizer with the run's hyperparameters plus --opt-kwargs (OpenCLIP's extra keywords)."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **cfg.opt_kwargs)
    check_opt_kwargs(cfg)
    try:
        return _make(groups, cfg.optimizer, kwargs)
    except TypeError as e:  # an unknown keyword: the constructor names it
        raise ConfigError(f"--opt-kwargs {cfg.opt_kwargs}: {cfg.optimizer} does not take it ({e})") from e


def check_opt_kwargs(cfg: OptimConfig) -> None:
    """An --opt-kwargs value of another type than the keyword's default (amsgrad=maybe): the
    constructor keeps it, and the first step would fail in the kernel or, worse, treat it as true.
    (Preflight calls it too, before the model is built.)"""
    params = inspect.signature(optimizer_class(cfg.optimizer)).parameters
    for key, value in cfg.opt_kwargs.items():
        default = params[key].default if key in params else None
        if isinstance(default, bool):
            fits = isinstance(value, bool)
        elif isinstance(default, int | float):
            fits = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            fits = True  # None (foreach, fused), a tuple or no default: the constructor's own checks
        if not fits:
            raise ConfigError(
                f"--opt-kwargs {key}={value!r}: {cfg.optimizer} takes a {type(default).__name__} there "
                f"(default {default!r}), e.g. --opt-kwargs {key}={default!r}"
            )


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    if name == "adamw":
        return torch.optim.AdamW
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ConfigError("--optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes") from e
        return bnb.optim.AdamW8bit
    raise ConfigError(f"unknown --optimizer {name!r}")


def _make(groups: list[dict], name: str, kwargs: dict) -> torch.optim.Optimizer:
    if name == "adamw":
        # Fused, not torch's default foreach: one pass over the state and no temporary the size of a
        # moment (foreach's sqrt(exp_avg_sq): 10 GB for ViT-bigG-14 unsharded). ViT-B-32 on the
        # CPU: 4.4-4.7x faster step, first-step peak 7.7 not 11.5 B/parameter (benchmarks/optimizer_step.py).
        kwargs.setdefault("fused", fusable(groups))
    return optimizer_class(name)(groups, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def squared_norm(tensors: list[torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """The sum of the tensors' squared L2 norms, in fp32, as torch's clip_grad_norm_ takes it: one
    multi-tensor kernel for every norm (a loop of pow, sum and add per tensor dispatched three
    operators per parameter: 2,900 a step for ViT-bigG-14, benchmarks/host_overhead.py)."""
    if not tensors:
        return torch.zeros((), device=device, dtype=torch.float32)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


def clip_by_total_norm_(local_grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients (local shards, plain tensors) so their global norm is at most max_norm.

    No host sync: the coefficient stays a device tensor, as in torch's clip_grad_norm_; one
    multi-tensor multiply for every gradient."""
    if local_grads:
        torch._foreach_mul_(local_grads, torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))


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


MOMENTS = ("exp_avg", "exp_avg_sq")
BNB_BLOCK = 256  # bitsandbytes' block size for 8-bit optimizer states
_BNB_KEYS = {"exp_avg": ("state1", "absmax1", "qmap1"), "exp_avg_sq": ("state2", "absmax2", "qmap2")}


def read_moments(state: dict) -> dict[str, torch.Tensor]:
    """A parameter's per-element optimizer state as fp32 tensors, what a checkpoint holds besides
    its step: the state itself for torch (and DeepSpeed) Adam (AMSGrad adds max_exp_avg_sq); for
    bitsandbytes' 8-bit AdamW, dequantised copies of its uint8 codes (or its fp32 state1/state2
    for tensors under min_8bit_size). Change them in place, then `write_moments`."""
    if "state1" not in state:
        return {
            key: value.detach() for key, value in state.items() if key != "step" and torch.is_tensor(value)
        }
    moments = {}
    for key, (codes, absmax, qmap) in _BNB_KEYS.items():
        if state[codes].dtype != torch.uint8:
            moments[key] = state[codes].detach()
        else:
            scale = state[absmax].repeat_interleave(BNB_BLOCK)[: state[codes].numel()]
            moments[key] = state[qmap][state[codes].reshape(-1).long()] * scale  # flat
    return moments


def write_moments(state: dict, moments: dict[str, torch.Tensor]) -> None:
    """Store moments from `read_moments` back (re-quantised over the same blocks for 8-bit)."""
    if "state1" not in state:
        return  # `read_moments` returned the state tensors themselves
    import bitsandbytes.functional as bnbf

    for key, (codes, absmax, qmap) in _BNB_KEYS.items():
        if state[codes].dtype == torch.uint8:
            out, quant = bnbf.quantize_blockwise(moments[key], code=state[qmap], blocksize=BNB_BLOCK)
            state[codes].copy_(out.view_as(state[codes]))
            state[absmax].copy_(quant.absmax)


def get_step(state: dict) -> int:
    step = state.get("step", 0)
    return int(step.item()) if torch.is_tensor(step) else int(step)


def set_step(state: dict, step: int) -> None:
    if torch.is_tensor(state.get("step")):
        state["step"].fill_(step)
    else:
        state["step"] = step


@torch.no_grad()
def create_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create the (zero) state of `params`, which are in the optimizer's groups, changing no
    parameter, so a fresh optimizer has tensors for a checkpoint to load into."""
    init_state = getattr(optimizer, "init_state", None)
    if init_state is not None:  # bitsandbytes creates zeroed (quantised) states directly
        wanted = {id(p) for p in params}
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) in wanted:
                    init_state(group, p, gi, pi)
        return
    saved = [(p.grad, p) for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0  # AdamW at lr 0: no update and no weight decay; the moments stay zero
    try:
        optimizer.step()
    finally:
        for grad, p in saved:
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
    for p in params:
        set_step(optimizer.state[p], 0)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class LocalShardOptimizer:
    """The FSDP2 engine's optimizer: --optimizer stepped over each parameter's local shard, as
    plain tensors. FSDP2's parameters are DTensors and the update is element-wise, so it needs
    nothing but the shard; DTensor's dispatch per parameter is host time saved, and bitsandbytes'
    AdamW8bit cannot step DTensors at all. The shards are views of the DTensors' storage, made once.
    `masters`: a parameter's fp32 master (engines/master_weights.py) is stepped in its place, with
    the gradient its master already holds."""

    def __init__(self, groups: list[dict], cfg: OptimConfig, *, masters: MasterWeights | None = None) -> None:
        self.groups = [list(g["params"]) for g in groups]
        self.params = [p for g in self.groups for p in g]
        self.shards = {}
        for p in self.params:
            master = masters.master(p) if masters else None
            self.shards[id(p)] = master if master is not None else local_tensor(p).detach()
        local_groups = [{**g, "params": [self.shards[id(p)] for p in g["params"]]} for g in groups]
        self.inner = make_optimizer(local_groups, cfg)
        self._taken = False  # whether take_grads set the shards' gradients for this step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def shard(self, param: torch.Tensor) -> torch.Tensor:
        return self.shards[id(param)]

    def take_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each parameter's gradient as a plain tensor, now also its shard's `.grad` for `step`:
        (sharded ones, replicated ones), for the engine's norm and clipping (one view each)."""
        sharded, replicated = [], []
        for p in self.params:
            shard = self.shard(p)
            if p.grad is not None:  # (a master holds its gradient already; zero_grad clears both)
                shard.grad = local_tensor(p.grad)
            if shard.grad is not None:
                (sharded if isinstance(p, DTensor) else replicated).append(shard.grad)
        self._taken = True
        return sharded, replicated

    def step(self) -> None:
        if not self._taken:
            self.take_grads()
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = self.shard(p).grad = None
        self._taken = False
