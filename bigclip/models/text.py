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
    device: torch.device | str | None = None,
) -> dict[str, nn.Module | nn.Parameter]:
    return {
        # OpenCLIP's registration order, so state dicts list keys identically.
        "transformer": Transformer(width, layers, heads, mlp_ratio, act_layer=act_layer, device=device),
        "token_embedding": nn.Embedding(vocab_size, width, device=device),
        "positional_embedding": nn.Parameter(torch.empty(context_length, width, device=device)),
        "ln_final": LayerNorm(width, device=device),
        "text_projection": nn.Parameter(torch.empty(width, output_dim, device=device)),
    }


def pool_end_of_text(x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Features at the end-of-text token, which has the highest id in each sequence (OpenCLIP's 'argmax')."""
    return x[torch.arange(x.shape[0], device=x.device), text.argmax(dim=-1)]
