"""An engine that is none of bigclip's, registered the way docs/extending.md says: one `Engine`
subclass and one `register_engine` call. Plain data parallelism (DDP's arithmetic without its
buckets): every rank holds the whole model, its gradients and its AdamW state in fp32, and `step`
averages the gradients over the ranks, clips and steps. Its plan is support/toy_engine_plan.py's
(the kind of the same name: the base class's `plan_kind`), and its own machine check refuses
any precision but fp32. tests/test_engine_registry.py trains, checkpoints and plans it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from bigclip.config.engine import register_engine
from bigclip.engines.base import Engine, StepStats
from bigclip.engines.optimizer import (
    clip_by_total_norm_,
    create_optimizer_state,
    make_optimizer,
    param_groups,
    read_moments,
    set_lr,
    set_step,
    write_moments,
)
from bigclip.errors import ConfigError
from bigclip.models.contract import TrainableModel, initial_values

NAME = "toy-replicas"


class ReplicasEngine(Engine):
    name = NAME

    @classmethod
    def check_machine(cls, cfg: Any, *, world_size: int, model_width: int) -> None:
        if cfg.engine.precision != "fp32":
            raise ConfigError(
                f"--engine {NAME} computes in fp32 only; this run has --precision {cfg.engine.precision}"
            )

    def build(
        self, model: TrainableModel, *, rebuild: Callable[[torch.device], TrainableModel] | None = None
    ) -> None:
        model.to_empty(device=self.runtime.device)
        params = dict(model.named_parameters())
        shapes = {name: p.shape for name, p in params.items()}
        with torch.no_grad():
            for name, full in initial_values(
                model, shapes, seed=self.cfg.optim.seed, device=self.runtime.device
            ):
                params[name].copy_(full)
        self.module = model
        self.optimizer = make_optimizer(param_groups(model, weight_decay=self.cfg.optim.wd), self.cfg.optim)

    def forward(self, images: torch.Tensor | None, texts: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return self.module(images, texts)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # gradients stay local (accumulating) until `step` averages them

    def step(self, *, lr: float) -> StepStats:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        for g in grads if self.runtime.world_size > 1 else ():
            dist.all_reduce(g, op=dist.ReduceOp.AVG)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if self.cfg.optim.grad_clip_norm > 0:
            clip_by_total_norm_(grads, norm, self.cfg.optim.grad_clip_norm)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.clamp_scalars()
        return StepStats(grad_norm=norm)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"model": _ModelState(self), "optim": _OptimState(self)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def full_param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self.module.named_parameters()}

    def _set_full_param(self, name: str, full: torch.Tensor) -> None:
        self.module.get_parameter(name).copy_(full)

    def _state(self, name: str) -> dict:
        param = self.module.get_parameter(name)
        if not self.optimizer.state.get(param):
            create_optimizer_state(self.optimizer, [param])
        return self.optimizer.state[param]

    def _set_full_moments(self, name: str, moments: dict[str, torch.Tensor]) -> None:
        state = self._state(name)
        current = read_moments(state)
        for key, full in moments.items():
            current[key].copy_(full.reshape(current[key].shape))
        write_moments(state, current)

    def _after_full_moments(self, step: int) -> None:
        for name in self.trained_names():
            set_step(self._state(name), step)


class _ModelState(Stateful):
    def __init__(self, engine: ReplicasEngine) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.engine.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.engine.module, state_dict)


class _OptimState(Stateful):
    def __init__(self, engine: ReplicasEngine) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": get_optimizer_state_dict(self.engine.module, self.engine.optimizer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.engine.module, self.engine.optimizer, state_dict["optimizer"])


def register() -> None:
    register_engine(NAME, f"{__name__}:ReplicasEngine")
