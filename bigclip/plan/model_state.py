"""Per-rank bytes of parameters, gradients and optimizer state, replaying each engine's sharding.

Rank 0 is planned: every engine gives it the largest piece.
  FSDP2 (fully_shard per block, then the root): each parameter is cut along dim 0 with
      torch.chunk semantics, so rank 0 holds ceil(rows / N) rows (all of them when rows < N);
      0-dim parameters (logit scale/bias) stay replicated. Sharded parameters, their gradients
      and AdamW's two moments are all in the precision's parameter dtype (fp32, or bf16 for
      pure_bf16). AdamW's `step` counters are 0-dim CPU tensors and are not counted.
  ZeRO-3: each parameter is flattened and cut into ceil(numel / N) elements per rank (padded).
      Per element of that partition: the bf16/fp16 (or fp32) compute copy, the gradient
      accumulator (DeepSpeed's grad_partitions_flat_buffer, in the compute dtype), and in the
      optimizer the fp32 master copy and two fp32 moments (bf16 with pure_bf16). Offloading moves
      the optimizer part (and the gradient accumulator) or the parameter partitions to CPU memory.
  ZeRO-1/2: the compute copy is whole on every rank; each optimizer parameter group is
      flattened, padded to a multiple of 2 x N elements and cut into N partitions that own the
      master copy and moments. ZeRO-1 keeps whole compute-dtype gradients; ZeRO-2 only the
      rank's gradient partition (plus the reduce buckets counted as communication).
bitsandbytes' AdamW8bit stores per tensor of at least 4,096 elements two uint8 codes per
element and one fp32 absmax per 256 elements and code, smaller tensors in fp32; under FSDP2 it
steps each local shard (so at large N many shards are small), under DeepSpeed the flat partitions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bigclip.engines.optimizer import excluded_from_weight_decay
from bigclip.models.shape import ParamShape
from bigclip.plan.spec import PlanSpec, dtype_bytes

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes Optimizer2State's default min_8bit_size
BNB_BLOCK = 256
ZERO12_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: groups padded to 2 x N elements


@dataclass(frozen=True)
class StateBytes:
    """Per-rank bytes of model state; `host_*` is what offloading keeps in CPU memory instead."""

    parameters: int
    gradients: int
    optimizer: int
    host_parameters: int = 0
    host_gradients: int = 0
    host_optimizer: int = 0

    @property
    def device_total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def host_total(self) -> int:
        return self.host_parameters + self.host_gradients + self.host_optimizer


def fsdp_shard_numel(param: ParamShape, world: int) -> int:
    """Elements of `param` on rank 0 under FSDP2 (dim-0 chunks; 0-dim parameters replicated)."""
    if not param.shape:
        return 1
    rows = param.shape[0]
    return min(math.ceil(rows / world), rows) * (param.numel // rows)


def zero3_partition_numel(param: ParamShape, world: int) -> int:
    return math.ceil(param.numel / world)


def adam_state_bytes(numels: Iterable[int], *, optimizer: str, state_bytes: int) -> int:
    """Bytes of AdamW's moments for tensors of these sizes (torch or bitsandbytes 8-bit)."""
    total = 0
    for n in numels:
        if optimizer == "adamw8bit" and n >= BNB_MIN_8BIT_SIZE:
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
        elif optimizer == "adamw8bit":
            total += 2 * 4 * n
        else:
            total += 2 * state_bytes * n
    return total


def fsdp_state(spec: PlanSpec, params: Sequence[ParamShape]) -> StateBytes:
    shards = [fsdp_shard_numel(p, spec.gpus) for p in params]
    b = dtype_bytes(spec.dtypes.param_dtype)
    return StateBytes(
        parameters=b * sum(shards),
        gradients=b * sum(shards),
        optimizer=adam_state_bytes(shards, optimizer=spec.optimizer, state_bytes=b),
    )


def zero3_state(spec: PlanSpec, params: Sequence[ParamShape]) -> StateBytes:
    parts = sum(zero3_partition_numel(p, spec.gpus) for p in params)
    compute = dtype_bytes(spec.dtypes.compute_dtype)
    master = dtype_bytes(spec.dtypes.param_dtype)
    parameters, gradients = compute * parts, compute * parts
    optimizer = master * parts + adam_state_bytes([parts], optimizer=spec.optimizer, state_bytes=master)
    return _offloaded(spec, parameters, gradients, optimizer)


def zero12_state(spec: PlanSpec, params: Sequence[ParamShape]) -> StateBytes:
    compute = dtype_bytes(spec.dtypes.compute_dtype)
    master = dtype_bytes(spec.dtypes.param_dtype)
    groups = [sum(p.numel for p in group) for group in weight_decay_groups(params)]
    align = ZERO12_ALIGNMENT * spec.gpus
    padded = [math.ceil(n / align) * align for n in groups if n]
    partition = sum(n // spec.gpus for n in padded)
    whole = sum(padded)
    gradients = compute * (whole if spec.engine == "zero1" else partition)
    optimizer = master * partition + adam_state_bytes(
        [n // spec.gpus for n in padded], optimizer=spec.optimizer, state_bytes=master
    )
    return _offloaded(spec, compute * whole, gradients, optimizer)


def _offloaded(spec: PlanSpec, parameters: int, gradients: int, optimizer: int) -> StateBytes:
    """Move what ZeRO's offload options keep in CPU memory from the device columns to host ones."""
    host_p = parameters if spec.zero.offload_param else 0
    host_o = optimizer if spec.zero.offload_optimizer else 0
    # With the optimizer offloaded, ZeRO-3 accumulates gradient partitions in (pinned) CPU memory.
    host_g = gradients if spec.zero.offload_optimizer and spec.engine == "zero3" else 0
    return StateBytes(parameters - host_p, gradients - host_g, optimizer - host_o, host_p, host_g, host_o)


def weight_decay_groups(params: Sequence[ParamShape]) -> list[list[ParamShape]]:
    """bigclip's two optimizer groups (no decay, decay), in `param_groups` order."""
    no_decay, decay = [], []
    for p in params:
        (no_decay if _no_decay(p) else decay).append(p)
    return [no_decay, decay]


def _no_decay(p: ParamShape) -> bool:
    class _Shape:  # excluded_from_weight_decay reads only .shape (or ZeRO-3's ds_shape)
        shape = p.shape

    return excluded_from_weight_decay(p.name, _Shape())  # type: ignore[arg-type]


def model_state(spec: PlanSpec, params: Sequence[ParamShape]) -> StateBytes:
    if spec.engine == "fsdp":
        return fsdp_state(spec, params)
    if spec.engine == "zero3":
        return zero3_state(spec, params)
    return zero12_state(spec, params)
