"""The text tower's pieces. OpenCLIP keeps them at the CLIP root (`token_embedding`,
`positional_embedding`, `transformer`, `ln_final`, `text_projection`), so they are built here
and attached by `bigclip.models.clip.CLIP`."""

from __future__ import annotations

import torch
from torch import nn

from bigclip.models.transformer import LayerNorm, Transformer


def build_text_modules(
    *,
    context_length: int,
    vocab_size: int,
    width: int,
    heads: int,
    layers: int,
    mlp_ratio: float,
    output_dim: int,
    act_layer: type[nn.Module] = nn.GELU,
    layer_scale: bool = False,
    device: torch.device | str | None = None,
) -> dict[str, nn.Module | nn.Parameter]:
    return {
        # OpenCLIP's registration order, so state dicts list keys identically.
        "transformer": Transformer(
            width, layers, heads, mlp_ratio, act_layer=act_layer, layer_scale=layer_scale, device=device
        ),
        "token_embedding": nn.Embedding(vocab_size, width, device=device),
        "positional_embedding": nn.Parameter(torch.empty(context_length, width, device=device)),
        "ln_final": LayerNorm(width, device=device),
        "text_projection": nn.Parameter(torch.empty(width, output_dim, device=device)),
    }


def pool_text(x: torch.Tensor, text: torch.Tensor, pool_type: str, eos_id: int) -> torch.Tensor:
    """Each sequence's features at one position, as OpenCLIP's `text_global_pool`: "argmax" the
    highest id (OpenAI's end-of-text), "eos" the first `eos_id`, "first" and "last" by position."""
    if pool_type == "first":
        return x[:, 0]
    if pool_type == "last":
        return x[:, -1]
    at = (text == eos_id).int().argmax(dim=-1) if pool_type == "eos" else text.argmax(dim=-1)
    return x[torch.arange(x.shape[0], device=x.device), at]
