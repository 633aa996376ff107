"""Per-rank bytes of model state (`StateBytes`) and what every engine's plan prices alike: AdamW's
moments and bigclip's two optimizer groups. How each engine splits the state across ranks is its
plan's (engine_plan.py: fsdp_plan.py, zero_plan.py). Rank 0 is planned: every engine gives it the
largest piece.

bitsandbytes' AdamW8bit stores per tensor of at least 4,096 elements two uint8 codes per
element and one fp32 absmax per 256 elements and code, smaller tensors in fp32; under FSDP2 it
steps each local shard (so at large N many shards are small), under DeepSpeed the flat partitions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bigclip.engines.optimizer import weight_decay_split
from bigclip.models.shape import ParamShape

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes Optimizer2State's default min_8bit_size
BNB_BLOCK = 256


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


def block_numels(params: Sequence[ParamShape]) -> dict[int, int]:
    """Elements per block (-1: the root's parameters, outside every block), the unit engines gather."""
    blocks: dict[int, int] = {}
    for p in params:
        blocks[p.block] = blocks.get(p.block, 0) + p.numel
    return blocks


def weight_decay_groups(params: Sequence[ParamShape]) -> list[list[ParamShape]]:
    """bigclip's two optimizer groups (no decay, decay), in `param_groups` order."""
    return list(weight_decay_split((p.name, p.shape, p) for p in params))
