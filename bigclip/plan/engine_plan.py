"""An engine kind's sharding plan, asked by name: the planner, the memory model, the checkpoint
simulation, the advice and the dry run call `engine_plan(spec.engine)` and never branch on a name.

A kind is how an engine lays a run out (FSDP2's `fsdp`; DeepSpeed's `zero1`, `zero2`, `zero3`, the
stage its JSON asks for). Its plan says what rank 0 holds of the model state, what it has in
flight (gathered parameters, reduce buffers), what lives across steps and what the optimizer step
allocates; how a tensor is split across ranks in a checkpoint (DCP's chunks: the checkpoint
simulation and its cost); and how to dry-run it (the engine's own code under a fake process group).

A new kind is one module with an `EnginePlan` subclass and one `register_engine_plan` call
(docs/extending.md; tests/test_engine_plan_registry.py registers a toy one from outside).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bigclip.errors import ConfigError
from bigclip.models.shape import ParamShape
from bigclip.plan.model_state import StateBytes

if TYPE_CHECKING:
    from bigclip.config import TrainConfig
    from bigclip.distributed import Runtime
    from bigclip.plan.spec import PlanSpec

Boxes = list[tuple[list[int], list[int]]]  # a rank's (offsets, sizes) of one tensor
BUILT_IN = ("bigclip.plan.fsdp_plan", "bigclip.plan.zero_plan")  # each registers its kinds on import


class EnginePlan:
    """One engine kind's plan. `name` is PlanSpec.engine's value."""

    name = ""
    lays_out_checkpoints = False  # rank_chunks gives its checkpoint chunks (the simulation prices them)

    def model_state(self, spec: PlanSpec, params: Sequence[ParamShape]) -> StateBytes:
        """Rank 0's bytes of parameters, gradients and optimizer state (device and host)."""
        raise NotImplementedError

    def communication(self, spec: PlanSpec, params: Sequence[ParamShape]) -> int:
        """Gathered parameters and unsharded gradients in flight (engine buffers), per rank."""
        raise NotImplementedError

    def persistent_gradients(self, spec: PlanSpec, state: StateBytes, params: Sequence[ParamShape]) -> int:
        """Gradient bytes held across the forward of the next micro-batch (accumulators)."""
        return state.gradients

    def step_temporaries(self, spec: PlanSpec, state: StateBytes) -> int:
        """What the optimizer step allocates on top of the model state."""
        return 0

    def rank0_numel(self, spec: PlanSpec, params: Sequence[ParamShape]) -> int:
        """Elements of model state rank 0 owns (and so checkpoints)."""
        raise NotImplementedError

    def rank_chunks(self, shape: tuple[int, ...], *, world: int, rank: int) -> Boxes | None:
        """Rank `rank`'s boxes of a sharded tensor of `shape` in a checkpoint (None: not laid out;
        the checkpoint simulation and its cost then skip the kind)."""
        return None

    def dry_run(self, cfg: TrainConfig, runtime: Runtime) -> dict[str, Any]:
        """Rank 0's measured parameter, gradient and optimizer bytes (plan/dryrun.py's process)."""
        raise ConfigError(f"no dry run for {self.name}")

    def communication_remedies(self) -> list[tuple[str, Callable[[PlanSpec], PlanSpec | None]]]:
        """Flags that shrink the communication buffers: (flags, the spec with them, or None)."""
        return []


ENGINE_PLANS: dict[str, EnginePlan] = {}


def register_engine_plan(plan: EnginePlan) -> EnginePlan:
    """Add (or replace) the plan of the kind `plan.name`."""
    ENGINE_PLANS[plan.name] = plan
    return plan


def engine_kinds() -> tuple[str, ...]:
    _load_built_in()
    return tuple(ENGINE_PLANS)


def engine_plan(name: str) -> EnginePlan:
    _load_built_in()
    if name not in ENGINE_PLANS:
        raise ConfigError(f"engine {name!r}: use one of {', '.join(ENGINE_PLANS)}")
    return ENGINE_PLANS[name]


def _load_built_in() -> None:
    for module in BUILT_IN:
        importlib.import_module(module)
