"""The Engine interface: the only thing the training loop talks to about parameters.

An engine takes a meta-device model, of which it sees only the model contract (models/contract.py),
shards and materialises it, owns the optimizer, and exposes a handful of verbs. The loop never
branches on which engine it has:

    engine.build(model, rebuild=...)            # shard, materialise, init, optimizer
    out = engine.forward(images, texts)         # features in the engine's precision
    with engine.no_sync(): engine.backward(l)   # accumulate without gradient sync
    stats = engine.step(lr=...)                 # clip, step, zero grads, clamp the model's scalars
    engine.checkpoint_state()                   # DCP Stateful model + optimizer state
    engine.load_full_weights(values, names)     # --pretrained: whole values in, shards kept
    engine.load_full_moments(values, names, step=s)   # OpenCLIP's AdamW state, the same way

Two class methods serve before any engine exists: `check_machine` (train/preflight.py, before the
process group) and `plan_kind` (the planner: which registered plan, plan/engine_plan.py, prices a
run of it). A new engine is a subclass and one `register_engine` (config/engine.py).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigclip.config import TrainConfig
from bigclip.distributed import Runtime
from bigclip.errors import StorageError
from bigclip.models.contract import TrainableModel


@dataclass
class StepStats:
    grad_norm: torch.Tensor  # before clipping; a tensor so reading it (a device sync) is the caller's choice
    skipped: bool = False  # fp16 overflow: the optimizer step was skipped and the loss scale lowered
    loss_scale: float = 1.0


class Engine(ABC):
    name: str = "engine"

    @classmethod
    def check_machine(cls, cfg: TrainConfig, *, world_size: int, model_width: int) -> None:
        """Refuse (ConfigError) settings of this engine that this machine or these flags cannot
        run, before a process group is formed. `model_width`: the model's widest residual stream.
        By default there are none beyond the run's own (train/preflight.py)."""
        return

    @classmethod
    def plan_kind(cls, cfg: TrainConfig, *, gpus: int, model_width: int) -> tuple[str, dict[str, Any]]:
        """The plan kind (plan/engine_plan.py) a run of `cfg` on `gpus` GPUs is, and the plan
        fields (plan/spec.py's PlanSpec) its own settings decide. By default the kind of its name."""
        return cls.name, {}

    def __init__(self, cfg: TrainConfig, runtime: Runtime) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.module: nn.Module | None = None  # the wrapped model; call `forward`, not this, in the loop

    @abstractmethod
    def build(
        self, model: TrainableModel, *, rebuild: Callable[[torch.device], TrainableModel] | None = None
    ) -> None:
        """Shard a meta-device model, materialise it on the device, initialise weights, make the
        optimizer. `rebuild(device)` makes the same model again, for an engine that must construct
        its parameters itself (ZeRO-3, partitioned as they are created)."""

    @abstractmethod
    def forward(self, images: torch.Tensor | None, texts: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The model's output dict (normalised features, exponentiated logit scale, optional bias)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def step(self, *, lr: float) -> StepStats:
        """Finish gradient reduction, clip, take an optimizer step at `lr`, zero gradients."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without cross-rank reduction."""
        yield

    @abstractmethod
    def checkpoint_state(self) -> dict[str, Any]:
        """{'model': ..., 'optim': ...} as `Stateful` objects that torch.distributed.checkpoint
        saves and loads in place, resharding to the current world size."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter gathered whole, on CPU, under its OpenCLIP name.
        For tests and small models; large models are consolidated offline, tensor by tensor."""

    @abstractmethod
    def full_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's whole (unsharded) shape under its OpenCLIP name; no communication."""

    @abstractmethod
    def _set_full_param(self, name: str, full: torch.Tensor) -> None:
        """Keep this rank's shard of `full` (fp32, on the device, the same on every rank)."""

    def _after_full_load(self) -> None:  # noqa: B027 (an optional hook)
        """Hook after the last `_set_full_param` (e.g. re-derive low-precision copies)."""

    def trained_names(self) -> list[str]:
        """Parameters the optimizer updates (not frozen by --lock-*), in model order."""
        return [name for name, p in self.module.named_parameters() if p.requires_grad]

    @abstractmethod
    def _set_full_moments(self, name: str, moments: dict[str, torch.Tensor]) -> None:
        """Keep this rank's shard of a trained parameter's whole Adam moments (fp32, on the device)."""

    @abstractmethod
    def _after_full_moments(self, step: int) -> None:
        """After the last `_set_full_moments`: store what is pending, set every step count."""

    @torch.no_grad()
    def load_full_moments(
        self, values: Iterable[torch.Tensor] | None, names: list[str], *, step: int
    ) -> None:
        """Collective: set the Adam moments of the trained parameters `names` and the optimizer's
        step count, as `load_full_weights` sets weights: rank 0 yields exp_avg then exp_avg_sq of
        each name in order (other ranks pass None), one whole tensor at a time is broadcast and
        every rank keeps its shard. Whatever the optimizer stores (fp32, bf16, 8-bit) is written
        from these fp32 values."""
        shapes = self.full_param_shapes()
        source = iter(values) if values is not None else None
        for name in names:
            moments = {key: self._broadcast_next(source, shapes[name]) for key in ("exp_avg", "exp_avg_sq")}
            self._set_full_moments(name, moments)
        self._after_full_moments(step)

    @torch.no_grad()
    def load_full_weights(self, values: Iterable[torch.Tensor] | None, names: list[str]) -> None:
        """Collective: set the parameters `names` (the same list on every rank) from whole values.

        Only rank 0 reads: `values` yields each named parameter's whole value (CPU, any float
        dtype) in order; other ranks pass None. Each value is broadcast from rank 0 and every
        rank keeps its shard, so no rank holds more than one whole parameter at a time (plus
        what the reader prefetches on rank 0). Parameters not named keep their initial values.
        """
        shapes = self.full_param_shapes()
        source = iter(values) if values is not None else None
        for name in names:
            self._set_full_param(name, self._broadcast_next(source, shapes[name]))
        self._after_full_load()

    def _broadcast_next(self, source: Iterator[torch.Tensor] | None, shape: tuple[int, ...]) -> torch.Tensor:
        """Collective: rank 0's next whole value from `source` (fp32, on the device) on every rank."""
        full, failure = self._next_full(source, shape)
        self._raise_together(failure)
        if self.runtime.world_size > 1:
            dist.broadcast(full, src=0)
        return full

    def _next_full(
        self, source: Iterator[torch.Tensor] | None, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor | None, Exception | None]:
        device = self.runtime.device
        if source is None:
            return torch.empty(shape, dtype=torch.float32, device=device), None
        try:
            return next(source).to(device=device, dtype=torch.float32).reshape(shape), None
        except Exception as e:  # damaged or unreachable weights, found mid-way: every rank must stop
            return None, e

    def _raise_together(self, failure: Exception | None) -> None:
        """Rank 0's read failure raised on every rank (the others would wait in broadcast forever).
        One flag per parameter: a host sync that is small beside the parameter's own broadcast."""
        if self.runtime.world_size > 1:
            flag = torch.tensor([failure is not None], dtype=torch.int32, device=self.runtime.device)
            dist.broadcast(flag, src=0)
            if flag.item():
                box = [f"{type(failure).__name__}: {failure}" if failure is not None else None]
                dist.broadcast_object_list(box, src=0)
                if failure is None:
                    raise StorageError(f"rank 0 could not read the weights: {box[0]}")
        if failure is not None:
            raise failure

    @torch.no_grad()
    def clamp_scalars(self) -> None:
        """Clamp the model's replicated scalars into their ranges after a step (OpenCLIP clamps
        the logit scale to log(100)), where each is held whole on every rank."""
        for name, (low, high) in self.module.replicated_scalars().items():
            if (low, high) != (None, None):
                self.module.get_parameter(name).clamp_(low, high)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.train(False)

    def unwrapped(self) -> TrainableModel:
        """The model itself (parameters may be sharded)."""
        return self.module

    @property
    def image_dtype(self) -> torch.dtype:
        """The dtype images enter the model in (its patch embedding's weights'), which the data
        loader normalises into on the device: bf16 under DeepSpeed's bf16 modes, fp32 under fp32."""
        return self.unwrapped().input_dtype
