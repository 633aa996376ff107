"""An engine kind that is none of bigclip's, registered the way docs/extending.md says: one
`EnginePlan` subclass and one `register_engine_plan` call. Plain data parallelism (DDP): every rank
holds the whole model state, gradients included, and all-reduces them in fixed-size buckets. Its
checkpoints are not laid out (no `rank_chunks`), and it has no dry run.
tests/test_engine_plan_registry.py plans, prices and advises runs of it."""

from __future__ import annotations

from collections.abc import Sequence

from bigclip.models.shape import ParamShape
from bigclip.plan.engine_plan import EnginePlan, register_engine_plan
from bigclip.plan.model_state import StateBytes, adam_state_bytes
from bigclip.plan.spec import PlanSpec, dtype_bytes

BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


class ReplicasPlan(EnginePlan):
    name = "toy-replicas"

    def model_state(self, spec: PlanSpec, params: Sequence[ParamShape]) -> StateBytes:
        b, numel = dtype_bytes(spec.dtypes.param_dtype), sum(p.numel for p in params)
        optimizer = adam_state_bytes([p.numel for p in params], optimizer=spec.optimizer, state_bytes=b)
        return StateBytes(parameters=b * numel, gradients=b * numel, optimizer=optimizer)

    def communication(self, spec: PlanSpec, params: Sequence[ParamShape]) -> int:
        return 2 * BUCKET_BYTES  # the bucket being reduced and the one filling

    def rank0_numel(self, spec: PlanSpec, params: Sequence[ParamShape]) -> int:
        return sum(p.numel for p in params)


def register() -> ReplicasPlan:
    return register_engine_plan(ReplicasPlan())  # type: ignore[return-value]
