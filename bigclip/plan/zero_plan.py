"""DeepSpeed ZeRO's plans (kinds `zero1`, `zero2`, `zero3`: the stage its JSON asks for).

ZeRO-3: each parameter is flattened and cut into ceil(numel / N) elements per rank (padded).
    Per element of that partition: the bf16/fp16 (or fp32) compute copy, the gradient
    accumulator (DeepSpeed's grad_partitions_flat_buffer, in the compute dtype), and in the
    optimizer the fp32 master copy and two fp32 moments (bf16 with pure_bf16). Offloading moves
    the optimizer part (and the gradient accumulator) or the parameter partitions to CPU memory.
    In a checkpoint a rank's chunks of a tensor are its flat slice, as the row-major boxes the
    engine saves it as.
ZeRO-1/2: the compute copy is whole on every rank; each optimizer parameter group is
    flattened, padded to a multiple of 2 x N elements and cut into N partitions that own the
    master copy and moments. ZeRO-1 keeps whole compute-dtype gradients; ZeRO-2 only the
    rank's gradient partition (plus the reduce buckets counted as communication). They hold
    the whole model on every rank, so they are not dry-run, and their checkpoints not simulated.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bigclip.engines.deepspeed_layout import flat_boxes
from bigclip.errors import ConfigError
from bigclip.models.shape import ParamShape
from bigclip.plan.dryrun import optimizer_state_bytes, phase, tensor_bytes
from bigclip.plan.engine_plan import Boxes, EnginePlan, register_engine_plan
from bigclip.plan.model_state import StateBytes, adam_state_bytes, block_numels, weight_decay_groups
from bigclip.plan.spec import PlanSpec, dtype_bytes

if TYPE_CHECKING:
    from bigclip.config import TrainConfig
    from bigclip.distributed import Runtime

ZERO12_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: groups padded to 2 x N elements


def zero3_partition_numel(param: ParamShape, world: int) -> int:
    return math.ceil(param.numel / world)


class ZeroPlan(EnginePlan):
    def __init__(self, stage: int) -> None:
        self.stage, self.name = stage, f"zero{stage}"
        self.lays_out_checkpoints = stage == 3  # ZeRO-1/2 checkpoints are not simulated

    def model_state(self, spec: PlanSpec, params: Sequence[ParamShape]) -> StateBytes:
        compute = dtype_bytes(spec.dtypes.compute_dtype)
        master = dtype_bytes(spec.dtypes.param_dtype)
        if self.stage == 3:
            parts = sum(zero3_partition_numel(p, spec.gpus) for p in params)
            optimizer = master * parts + adam_state_bytes(
                [parts], optimizer=spec.optimizer, state_bytes=master
            )
            return self._offloaded(spec, compute * parts, compute * parts, optimizer)
        groups = [sum(p.numel for p in group) for group in weight_decay_groups(params)]
        align = ZERO12_ALIGNMENT * spec.gpus
        padded = [math.ceil(n / align) * align for n in groups if n]
        partition = sum(n // spec.gpus for n in padded)
        whole = sum(padded)
        gradients = compute * (whole if self.stage == 1 else partition)
        optimizer = master * partition + adam_state_bytes(
            [n // spec.gpus for n in padded], optimizer=spec.optimizer, state_bytes=master
        )
        return self._offloaded(spec, compute * whole, gradients, optimizer)

    def _offloaded(self, spec: PlanSpec, parameters: int, gradients: int, optimizer: int) -> StateBytes:
        """Move what ZeRO's offload options keep in CPU memory from the device columns to host ones."""
        host_p = parameters if spec.zero.offload_param else 0
        host_o = optimizer if spec.zero.offload_optimizer else 0
        # With the optimizer offloaded, ZeRO-3 accumulates gradient partitions in (pinned) CPU memory.
        host_g = gradients if spec.zero.offload_optimizer and self.stage == 3 else 0
        return StateBytes(parameters - host_p, gradients - host_g, optimizer - host_o, host_p, host_g, host_o)

    def communication(self, spec: PlanSpec, params: Sequence[ParamShape]) -> int:
        a = dtype_bytes(spec.dtypes.compute_dtype)
        if self.stage < 3:
            return a * 2 * spec.zero.reduce_bucket_size  # the reduce buckets (overlap_comm: two)
        blocks = block_numels(params)
        blocks.pop(-1, 0)
        largest = max(blocks.values())
        persistent = sum(p.numel for p in params if p.numel <= spec.zero.persistence_threshold)
        biggest_root = max(p.numel for p in params if p.block == -1)
        return a * (2 * max(largest, biggest_root) + persistent + spec.zero.reduce_bucket_size + largest)

    def step_temporaries(self, spec: PlanSpec, state: StateBytes) -> int:
        if spec.optimizer == "adamw8bit" or state.optimizer == 0:
            return 0  # blockwise 8-bit kernels update in place; offloaded optimizers step on the CPU
        return state.optimizer // 3  # ZeRO's fp32 gradient partition (optimizer: fp32 master + 2 moments)

    def rank0_numel(self, spec: PlanSpec, params: Sequence[ParamShape]) -> int:
        if self.stage == 3:
            return sum(zero3_partition_numel(p, spec.gpus) for p in params)
        return math.ceil(sum(p.numel for p in params) / spec.gpus)

    def rank_chunks(self, shape: tuple[int, ...], *, world: int, rank: int) -> Boxes | None:
        if self.stage < 3:
            return None
        per_rank = math.ceil(math.prod(shape) / world)
        first = rank * per_rank
        return flat_boxes(shape, first, min(first + per_rank, math.prod(shape)))

    def dry_run(self, cfg: TrainConfig, runtime: Runtime) -> dict[str, Any]:
        if self.stage < 3:
            raise ConfigError(f"no dry run for {self.name}: it holds the whole model on every rank")
        return zero3_dry_run(cfg, runtime)


def zero3_dry_run(cfg: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    from bigclip.engines.deepspeed_state import ensure_optimizer_state

    ds_engine = zero3_engine(cfg, runtime)
    zero = ds_engine.optimizer
    flats = list(zero.fp32_partitioned_groups_flat)
    ensure_optimizer_state(zero.optimizer, flats, [zero.sub_group_to_group_id[i] for i in range(len(flats))])
    phase(2)
    return {
        "parameters": tensor_bytes(p.ds_tensor for p in ds_engine.module.parameters()),
        "gradients": tensor_bytes([zero.grad_partitions_flat_buffer]),
        "optimizer": tensor_bytes(flats) + optimizer_state_bytes(zero.optimizer),
    }


def zero3_engine(cfg: TrainConfig, runtime: Runtime) -> Any:
    """Rank `runtime.rank`'s DeepSpeed ZeRO-3 engine (`deepspeed.initialize`'s), built as
    `DeepSpeedEngine.build` builds it but for the initial weights' values (the partitions hold
    whatever memory held): what a dry run, or a benchmark of the checkpoint state, needs."""
    from bigclip.engines.deepspeed import DeepSpeedEngine, scalar_parameter_fixes
    from bigclip.engines.optimizer import make_optimizer, param_groups
    from bigclip.models.from_config import build_model, model_factory

    phase(0)
    os.environ.update(RANK=str(runtime.rank), WORLD_SIZE=str(runtime.world_size), LOCAL_RANK="0")
    engine = DeepSpeedEngine(cfg, runtime)
    plan = engine.resolve_plan(build_model(cfg))
    if plan.stage != 3 or plan.offload_optimizer or plan.offload_param:
        raise ConfigError("the DeepSpeed dry run covers ZeRO-3 without offload (e.g. ds_configs/zero3.json)")
    engine.deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    with scalar_parameter_fixes():
        model = engine._materialise(build_model(cfg), rebuild=model_factory(cfg))
        engine._prepare_blocks(model)
        optimizer = make_optimizer(param_groups(model, weight_decay=cfg.optim.wd), cfg.optim)
        phase(1)
        ds_engine, *_ = engine.deepspeed.initialize(
            model=model, optimizer=optimizer, config=engine.plan.config, dist_init_required=False
        )
    return ds_engine


for _stage in (1, 2, 3):
    register_engine_plan(ZeroPlan(_stage))
