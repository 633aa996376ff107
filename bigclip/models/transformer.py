"""The residual attention block: the unit of sharding, activation checkpointing and compile.

Parameter names and shapes follow OpenCLIP (`ln_1`, `attn.in_proj_weight`, `attn.in_proj_bias`,
`attn.out_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`) so OpenCLIP state dicts load unchanged, but
attention runs through `scaled_dot_product_attention` instead of `nn.MultiheadAttention`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from bigclip.models.activation_checkpointing import BlockCheckpointing, block_plan
from bigclip.models.contract import LinearSlot


class LayerNorm(nn.LayerNorm):
    """LayerNorm that follows its input's dtype, so fp32 gains can serve bf16 activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class QuickGELU(nn.Module):
    """OpenAI CLIP's activation, used by the `-quickgelu` model variants."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class LayerScale(nn.Module):
    """A learned per-channel gain on a residual branch (OpenCLIP's `ls_1`/`ls_2`, CaiT's LayerScale)."""

    def __init__(self, width: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.empty(width, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.to(x.dtype)


class Attention(nn.Module):
    """Multi-head self-attention with nn.MultiheadAttention's parameter layout.

    `in_proj` is the function that applies the fused QKV projection; int8 layers replace it
    (see bigclip.ops.int8.switchback) while the parameters keep their names.
    """

    def __init__(self, width: int, heads: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width, device=device))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width, device=device))
        self.out_proj = nn.Linear(width, width, device=device)
        self.in_proj: Callable[..., torch.Tensor] = F.linear

    def forward(self, x: torch.Tensor, *, causal: bool = False) -> torch.Tensor:
        batch, seq, width = x.shape
        qkv = self.in_proj(x, self.in_proj_weight, self.in_proj_bias)
        # [B, S, 3, H, D] -> 3 x [B, H, S, D]
        q, k, v = qkv.view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, width))


class ResidualAttentionBlock(nn.Module):
    def __init__(
        self,
        width: int,
        heads: int,
        mlp_ratio: float,
        *,
        act_layer: type[nn.Module] = nn.GELU,
        layer_scale: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        mlp_width = int(width * mlp_ratio)
        # OpenCLIP's registration order: ln_1, attn, ls_1, ln_2, mlp, ls_2.
        self.ln_1 = LayerNorm(width, device=device)
        self.attn = Attention(width, heads, device=device)
        self.ls_1 = LayerScale(width, device=device) if layer_scale else nn.Identity()
        self.ln_2 = LayerNorm(width, device=device)
        self.mlp = nn.Sequential(
            OrderedDict(
                c_fc=nn.Linear(width, mlp_width, device=device),
                gelu=act_layer(),
                c_proj=nn.Linear(mlp_width, width, device=device),
            )
        )
        self.ls_2 = LayerScale(width, device=device) if layer_scale else nn.Identity()
        self.checkpointing: BlockCheckpointing | None = None  # see bigclip.models.activation_checkpointing

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        ckpt = self.checkpointing
        if ckpt is not None and self.training and torch.is_grad_enabled():
            # Inside the block, so inside the engine's unit (FSDP2/ZeRO-3 hooks run around it).
            # Non-reentrant: composes with those parameter hooks and with torch.compile.
            return checkpoint(self._forward, x, causal, use_reentrant=False, **ckpt.checkpoint_kwargs())
        return self._forward(x, causal)

    def _forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        x = x + self.ls_1(self.attn(self.ln_1(x), causal=causal))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


def block_linears(prefix: str, block: ResidualAttentionBlock) -> list[LinearSlot]:
    """The model contract's swappable linears of one block named `prefix`: the MLP's c_fc and
    c_proj, the attention's fused QKV (a projection over `in_proj_weight`) and output projection.
    Sizes come from the modules, not the parameters, which ZeRO-3 may have partitioned already."""
    mlp, attn, width = block.mlp, block.attn, block.attn.out_proj.in_features
    slots = [LinearSlot(f"{prefix}.mlp.{a}", mlp, a, "mlp", in_features=getattr(mlp, a).in_features,
                        out_features=getattr(mlp, a).out_features) for a in ("c_fc", "c_proj")]  # fmt: skip
    slots.append(
        LinearSlot(f"{prefix}.attn.in_proj", attn, "in_proj", "attention", "projection", width, 3 * width)
    )
    slots.append(LinearSlot(f"{prefix}.attn.out_proj", attn, "out_proj", "attention", "linear", width, width))
    return slots


class Transformer(nn.Module):
    def __init__(
        self,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float = 4.0,
        *,
        act_layer: type[nn.Module] = nn.GELU,
        layer_scale: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.width = width
        self.layers = layers
        self.resblocks = nn.ModuleList(
            ResidualAttentionBlock(
                width, heads, mlp_ratio, act_layer=act_layer, layer_scale=layer_scale, device=device
            )
            for _ in range(layers)
        )

    def set_grad_checkpointing(self, enable: bool = True, *, every: int = 1, policy: str = "full") -> None:
        plan = block_plan(self.layers, every=every, policy=policy)
        for block, ckpt in zip(self.resblocks, plan):
            block.checkpointing = ckpt if enable else None

    @property
    def grad_checkpointing(self) -> bool:
        return any(block.checkpointing is not None for block in self.resblocks)

    def forward(self, x: torch.Tensor, *, causal: bool = False) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x, causal)
        return x
