"""Record the dtypes of what each op inside a residual block produces, and what SDPA receives.

A TorchDispatchMode sees every aten op with its real outputs; forward hooks on the blocks mark
which ops run inside one (entered after and left before an engine's own hooks, so FSDP2's
all-gather and reshard and ZeRO-3's fetch and release stay outside).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Outputs that are fp32 by design (index in the op's outputs): LayerNorm's per-token mean and
# 1/std, the attention kernels' log-sum-exp (saved for backward), SwitchBack's per-row scales.
FP32_BY_DESIGN = {
    "native_layer_norm": (1, 2),
    "_scaled_dot_product_flash_attention_for_cpu": (1,),
    "_scaled_dot_product_flash_attention": (1,),
    "_scaled_dot_product_efficient_attention": (1,),
    "_scaled_dot_product_cudnn_attention": (1,),
}
FP32_OPS_BY_DESIGN = ("bigclip::switchback_quantize",)  # int8 values and their fp32 scales
SDPA_PREFIX = "_scaled_dot_product"


@dataclass
class SdpaCall:
    op: str
    dtypes: tuple[torch.dtype, ...]
    last_dim_contiguous: bool
    head_dim: int
    has_mask: bool


@dataclass
class BlockOps:
    fp32: list[str] = field(default_factory=list)  # "op output#i shape" of unexpected fp32 outputs
    ops: int = 0
    sdpa: list[SdpaCall] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, record: BlockOps) -> None:
        super().__init__()
        self.record, self.depth = record, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if self.depth:
            self._note(func, args, out)
        return out

    def _note(self, func: torch._ops.OpOverload, args: tuple, out: object) -> None:
        name = func.__name__.split(".")[0]
        qualified = str(func._schema.name)
        self.record.ops += 1
        if name.startswith(SDPA_PREFIX) and "backward" not in name:
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 and isinstance(args[3], torch.Tensor) else None
            self.record.sdpa.append(
                SdpaCall(name, (q.dtype, k.dtype, v.dtype), all(t.stride(-1) == 1 for t in (q, k, v)),
                         q.shape[-1], mask is not None)
            )  # fmt: skip
        if qualified.startswith(FP32_OPS_BY_DESIGN):
            return
        outputs, _ = tree_flatten(out)
        for i, t in enumerate(outputs):
            if (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.float32
                and i not in FP32_BY_DESIGN.get(name, ())
            ):
                self.record.fp32.append(f"{qualified} output {i} {list(t.shape)}")


@contextlib.contextmanager
def record_block_ops(blocks: list[nn.Module]) -> Iterator[BlockOps]:
    """Within the block: ops of every forward of `blocks` (and the backward nothing marks)."""
    record = BlockOps()
    recorder = _Recorder(record)

    def enter(*_: object) -> None:
        recorder.depth += 1

    def leave(*_: object) -> None:
        recorder.depth -= 1

    handles = [b.register_forward_pre_hook(enter) for b in blocks]  # after the engine's own
    handles += [b.register_forward_hook(leave, prepend=True) for b in blocks]  # before the engine's
    try:
        with recorder:
            yield record
    finally:
        for h in handles:
            h.remove()
