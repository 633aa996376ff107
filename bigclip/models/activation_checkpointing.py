"""Activation checkpointing of residual blocks: which blocks, and what each one keeps.

The checkpoint is taken *inside* a block's own `forward` (see `ResidualAttentionBlock`), not by the
Transformer around the call. An engine wraps each block as its unit (FSDP2's `fully_shard`,
ZeRO-3's leaf modules), so the unit's hooks run outside the checkpoint: the block's input has
already been cast to the compute dtype and its parameters gathered when the checkpointed function
first runs, and the recompute in backward replays exactly that function on the saved (cast) input.
This is where torchtitan applies its checkpoint wrapper, and it does not depend on how a torch
version's FSDP2 treats a recompute (torch < 2.13 skipped FSDP2's input cast on a checkpoint taken
around the FSDP2 module: amp_bf16 + checkpointing crashed with "Float and BFloat16").

Two knobs, both cheap to reason about (`bigclip plan` prices each):
  - every: checkpoint one block in `every` (1: every block; 2: blocks 0, 2, 4...). The others keep
    all their activations and are not recomputed.
  - policy: `full` keeps only a checkpointed block's input; `ops` is torchtitan's op-level selective
    checkpointing: also keep the attention output and every other matmul output, the expensive ops,
    so backward recomputes mostly LayerNorms, GELUs and the cheaper half of the matmuls.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

POLICIES = ("full", "ops")

_ATTENTION_OPS = {
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)  # the set of SDPA backends differs between torch versions
}
# `_scaled_mm`: the fp8 linears' GEMM. `max`: an fp8 cast's absolute maximum, a reduction over a
# whole tensor kept for the price of a scalar (torchtitan keeps it too).
_MATMUL_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_mm.default,
}
_SCALE_OPS = {torch.ops.aten.max.default}


@dataclass(frozen=True)
class BlockCheckpointing:
    """How one block is checkpointed (None on a block means: not checkpointed)."""

    policy: str = "full"
    # torch compares each recomputed saved tensor's shape and dtype with the forward's. An engine
    # that swaps a frozen parameter's storage during the recompute turns this off: see
    # `skip_recompute_check`.
    check_recompute: bool = True

    def checkpoint_kwargs(self) -> dict:
        """Extra arguments of `torch.utils.checkpoint.checkpoint` for this policy. `full` passes
        no context_fn: torch 2.11's dynamo refuses any it cannot inline (even the no-op default)."""
        kwargs = {} if self.check_recompute else {"determinism_check": "none"}
        if self.policy == "full":
            return kwargs
        return kwargs | {
            "context_fn": functools.partial(create_selective_checkpoint_contexts, _save_ops_policy())
        }


def _save_ops_policy():  # noqa: ANN202
    """torchtitan's op SAC: save attention outputs and every second matmul output of a block.

    The counter lives in a closure made per checkpointed call, so the forward and its recompute
    count the same matmuls in the same order and take the same decisions (a must: a mismatch
    raises in backward)."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
        if op in _ATTENTION_OPS or op in _SCALE_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMUL_OPS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 1:  # the 1st, 3rd... matmul: QKV, c_fc (the wider outputs)
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def skip_recompute_check(blocks: Iterable[nn.Module]) -> None:
    """Turn off torch's recompute metadata check on each checkpointed block of `blocks`.

    For ZeRO-3 with frozen parameters (--lock-image/--lock-text): the checkpoint keeps a frozen
    parameter by reference (only tensors that require grad are detached), and DeepSpeed 0.18.3
    releases it again (0 elements) when each submodule's recomputed forward ends, so torch reads
    a 0-element "recomputed" shape and raises (0.19.8 keeps it gathered until the backward). The
    values backward uses are right: DeepSpeed
    gathers a submodule's parameters again before that submodule's backward runs.
    """
    for block in blocks:
        ckpt = getattr(block, "checkpointing", None)
        if ckpt is not None:
            block.checkpointing = dataclasses.replace(ckpt, check_recompute=False)


def block_plan(layers: int, *, every: int, policy: str) -> list[BlockCheckpointing | None]:
    """Per block of a tower: its checkpointing, or None for a block that keeps its activations."""
    if every < 1:
        raise ValueError(f"checkpoint every N blocks needs N >= 1, got {every}")
    if policy not in POLICIES:
        raise ValueError(f"unknown checkpointing policy {policy!r}; choose from {POLICIES}")
    return [BlockCheckpointing(policy) if i % every == 0 else None for i in range(layers)]
