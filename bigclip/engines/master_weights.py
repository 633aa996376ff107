"""Parameters held in the compute dtype, each with an fp32 master copy that the optimizer steps.

This is what the FSDP engine does at a world of one under a mixed precision, instead of FSDP2.
There FSDP2 has nothing to shard but still pays for its machinery on every unit and every step:
it copies each fp32 parameter into a bf16 buffer to "gather" it, and copies each gradient into an
fp32 buffer to "reduce" it. At ViT-bigG-14's depth that is about 1,000 casts, 1,000 copies and the
hooks around them, per unit gathered. The numbers come out the same as FSDP2's:
- the module computes from bf16 (or fp16) parameters, as FSDP2's MixedPrecisionPolicy does;
- each micro-batch's gradients are added into fp32 master gradients, as FSDP2 accumulates in the
  reduce dtype;
- the optimizer steps the fp32 masters, and the step copies them back into the parameters.
The masters are what a checkpoint holds, so a run saved here resumes on any world size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class MasterWeights:
    """fp32 masters of `params`, which become `compute_dtype` parameters of their module.

    Each master reuses its parameter's fp32 storage, so making them allocates only the low-precision
    copies. The Parameter objects stay the same: hooks, names and optimizer groups still find them."""

    @torch.no_grad()
    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], compute_dtype: torch.dtype) -> None:
        self.params, self.masters = [], []
        self._by_name: dict[str, torch.Tensor] = {}
        for name, param in named_params:
            master = param.detach()
            param.data = master.to(compute_dtype)
            self.params.append(param)
            self.masters.append(master)
            self._by_name[name] = master
        self._of = {id(p): m for p, m in zip(self.params, self.masters)}

    def master(self, param: nn.Parameter) -> torch.Tensor | None:
        """The parameter's fp32 master, or None for one kept in its own dtype."""
        return self._of.get(id(param))

    def by_name(self) -> dict[str, torch.Tensor]:
        """Each master under its parameter's name: the values a checkpoint holds."""
        return dict(self._by_name)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Move each parameter's low-precision gradient into its master's fp32 gradient (added to
        what earlier micro-batches left there), freeing the low-precision one."""
        for param, master in zip(self.params, self.masters):
            grad = param.grad
            if grad is None:
                continue
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
            param.grad = None

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Every parameter set from its master, in one multi-tensor copy (rounded to its dtype)."""
        if self.params:
            torch._foreach_copy_(self.params, self.masters)
