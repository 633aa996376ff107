"""Model FLOPs of a CLIP forward pass, counted from its config (2 per multiply-add of every matmul).

The planner's step time and the benchmarks' MFU both divide by this, so they share one count.
A training step costs 3x the forward (backward is twice the forward).
"""

from __future__ import annotations

from bigclip.models.clip import CLIPConfig
from bigclip.models.vision import kept_patches


def tower_flops(*, width: int, layers: int, mlp: int, tokens: int) -> float:
    """Residual blocks: QKV + out projection (4 w^2), MLP (2 w m), attention scores and values (2 s w)."""
    return layers * tokens * (2 * (4 * width * width + 2 * width * mlp) + 4 * tokens * width)


def forward_flops(cfg: CLIPConfig, *, patch_dropout: float = 0.0) -> float:
    """Forward FLOPs of one image-text pair; patch dropout shortens the image tower's sequence."""
    v, t = cfg.vision_cfg, cfg.text_cfg
    patches = (v.image_size // v.patch_size) ** 2
    image = tower_flops(width=v.width, layers=v.layers, mlp=int(v.width * v.mlp_ratio),
                        tokens=1 + kept_patches(patches, patch_dropout))  # fmt: skip
    text = tower_flops(
        width=t.width, layers=t.layers, mlp=int(t.width * t.mlp_ratio), tokens=t.context_length
    )
    embed = 2 * 3 * v.patch_size**2 * v.width * patches  # the patch embedding sees every patch
    return image + text + embed + 2 * (v.width + t.width) * cfg.embed_dim
