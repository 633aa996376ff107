"""FSDP2's plan (kind `fsdp`): fully_shard per block, then the root.

Each parameter is cut along dim 0 with torch.chunk semantics, so rank 0 holds ceil(rows / N) rows
(all of them when rows < N); 0-dim parameters (logit scale/bias) stay replicated. Sharded
parameters, their gradients and AdamW's two moments are all in the precision's parameter dtype
(fp32, or bf16 for pure_bf16). AdamW's `step` counters are 0-dim CPU tensors and are not counted.
In a checkpoint a rank's chunk of a tensor is DTensor's own Shard(0) slice of whole rows.

At one GPU the engine uses no FSDP2 (engines/master_weights.py): under a mixed precision each
parameter is held in the compute dtype beside its fp32 master, the masters' fp32 gradients live from
the end of backward to the step (across micro-batches under --accum-freq), and nothing is gathered.
The compute-dtype gradients fill up in backward as the activations drain, and are freed into the
masters before the step: they are counted in neither peak.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor.placement_types import Shard

from bigclip.models.shape import ParamShape
from bigclip.plan.dryrun import CPU, dot_loss, optimizer_state_bytes, phase, tensor_bytes
from bigclip.plan.engine_plan import Boxes, EnginePlan, register_engine_plan
from bigclip.plan.model_state import StateBytes, adam_state_bytes, block_numels
from bigclip.plan.spec import PlanSpec, dtype_bytes

if TYPE_CHECKING:
    from bigclip.config import TrainConfig
    from bigclip.distributed import Runtime


def _compute_copies(spec: PlanSpec, params: Sequence[ParamShape]) -> int:
    """At one GPU under a mixed precision: the compute-dtype parameters beside the fp32 masters
    (0-dim scalars are their own masters)."""
    p = spec.dtypes
    if spec.gpus > 1 or p.compute_dtype == p.param_dtype:
        return 0
    return dtype_bytes(p.compute_dtype) * sum(param.numel for param in params if param.shape)


def fsdp_shard_numel(param: ParamShape, world: int) -> int:
    """Elements of `param` on rank 0 under FSDP2 (dim-0 chunks; 0-dim parameters replicated)."""
    if not param.shape:
        return 1
    rows = param.shape[0]
    return min(math.ceil(rows / world), rows) * (param.numel // rows)


@functools.cache
def _row_split(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(rows, first row) of a rank's Shard(0) slice, by DTensor's own split (cached: it is slow)."""
    size, start = Shard.local_shard_size_and_offset(rows, world, rank)
    return int(size), int(start if start is not None else rows)


class FSDPPlan(EnginePlan):
    name = "fsdp"
    lays_out_checkpoints = True

    def model_state(self, spec: PlanSpec, params: Sequence[ParamShape]) -> StateBytes:
        shards = [fsdp_shard_numel(p, spec.gpus) for p in params]
        b = dtype_bytes(spec.dtypes.param_dtype)
        return StateBytes(
            parameters=b * sum(shards) + _compute_copies(spec, params),
            gradients=b * sum(shards),
            optimizer=adam_state_bytes(shards, optimizer=spec.optimizer, state_bytes=b),
        )

    def communication(self, spec: PlanSpec, params: Sequence[ParamShape]) -> int:
        if spec.gpus == 1:
            return 0  # nothing to gather
        p = spec.dtypes
        a, reduce_b = dtype_bytes(p.compute_dtype), dtype_bytes(p.reduce_dtype)
        blocks = block_numels(params)
        root = blocks.pop(-1, 0)
        sizes, n = [blocks[i] for i in sorted(blocks)], spec.fsdp_blocks_per_unit
        largest = max(sum(sizes[i : i + n]) for i in range(0, len(sizes), n))  # the engine's units
        gathered = sum(sizes) if not spec.reshard_after_forward else 2 * largest
        # The unsharded gradients of the unit in backward, and their copy in the reduce dtype.
        reduce_scatter = largest * (a + (reduce_b if reduce_b != a else 0))
        return a * (gathered + root) + reduce_scatter  # the root stays gathered, in the compute dtype

    def persistent_gradients(self, spec: PlanSpec, state: StateBytes, params: Sequence[ParamShape]) -> int:
        # Under no_sync, FSDP2 accumulates unsharded gradients (reduce dtype) across passes.
        if spec.gpus == 1:  # the masters' gradients
            return state.gradients if spec.accum_freq > 1 else 0
        reduce_b = dtype_bytes(spec.dtypes.reduce_dtype)
        return reduce_b * sum(p.numel for p in params) if spec.accum_freq > 1 else 0

    def step_temporaries(self, spec: PlanSpec, state: StateBytes) -> int:
        return 0  # fused AdamW updates in place (foreach would allocate a moment-sized buffer)

    def rank0_numel(self, spec: PlanSpec, params: Sequence[ParamShape]) -> int:
        return sum(fsdp_shard_numel(p, spec.gpus) for p in params)

    def rank_chunks(self, shape: tuple[int, ...], *, world: int, rank: int) -> Boxes | None:
        rows, start = _row_split(shape[0], world, rank)
        return [([start] + [0] * (len(shape) - 1), [rows, *shape[1:]])] if rows else []

    def dry_run(self, cfg: TrainConfig, runtime: Runtime) -> dict[str, Any]:
        """FSDPEngine's `_shard` on the meta-device model; then, under FakeTensorMode (shapes and
        dtypes, no storage), the rest of its `build`, one forward and backward on a synthetic
        batch and its real `step`; gradients are counted after backward."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from bigclip.engines.fsdp import FSDPEngine
        from bigclip.models.from_config import build_model, synthetic_batch
        from bigclip.train.trainer import contrastive_loss

        phase(0)
        engine = FSDPEngine(cfg, runtime)
        model = build_model(cfg)
        engine._shard(model)  # outside FakeTensorMode: the device mesh reads its rank map
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=CPU)  # no weight init: it needs values, which fake tensors lack
            engine._adopt(model)
            engine.scaler = None  # a loss scale's finiteness check reads a value
            phase(1)
            loss = contrastive_loss(dot_loss, engine.forward(*synthetic_batch(cfg)))
            engine.backward(loss)
            masters = engine.masters.masters if engine.masters else []  # at a world of one
            grads = tensor_bytes(t.grad for t in [*model.parameters(), *masters] if t.grad is not None)
            engine.step(lr=cfg.optim.lr)
            phase(2)
            return {
                "parameters": tensor_bytes([*model.parameters(), *masters]),
                "gradients": grads,
                "optimizer": optimizer_state_bytes(engine.optimizer.inner),
            }

    def communication_remedies(self) -> list:
        return [("--reshard-after-forward",
                 lambda s: None if s.reshard_after_forward else replace(s, reshard_after_forward=True)),
                ("--fsdp-blocks-per-unit 1",
                 lambda s: None if s.fsdp_blocks_per_unit == 1 else replace(s, fsdp_blocks_per_unit=1))]  # fmt: skip


register_engine_plan(FSDPPlan())
