"""The image tower: OpenCLIP's VisionTransformer (class-token or average pooling), with patch dropout."""

from __future__ import annotations

import torch
from torch import nn

from bigclip.models.clip_family import kept_patches
from bigclip.models.transformer import LayerNorm, Transformer


class PatchDropout(nn.Module):
    """Drop a random subset of patch tokens per image while training (FLIP, arXiv:2212.00794).

    The class token is always kept; at least one patch survives. Identity in eval mode.
    """

    def __init__(self, prob: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch dropout must be in [0, 1), got {prob}")
        self.prob = prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.prob == 0.0:
            return x
        cls_token, patches = x[:, :1], x[:, 1:]
        batch, num_patches, width = patches.shape
        keep = kept_patches(num_patches, self.prob)
        scores = torch.rand(batch, num_patches, device=x.device)
        kept = scores.topk(keep, dim=-1).indices  # [B, keep]
        patches = patches.gather(1, kept.unsqueeze(-1).expand(-1, -1, width))
        return torch.cat([cls_token, patches], dim=1)


class VisionTransformer(nn.Module):
    def __init__(
        self,
        *,
        image_size: int,
        patch_size: int,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float,
        output_dim: int,
        patch_dropout: float = 0.0,
        act_layer: type[nn.Module] = nn.GELU,
        layer_scale: bool = False,
        no_ln_pre: bool = False,
        pool_type: str = "tok",
        final_ln_after_pool: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.image_size = image_size
        self.patch_size = patch_size
        self.pool_type = pool_type
        # LayerNorm is per token: for the class token, pooling before ln_post is equivalent and cheaper.
        self.ln_after_pool = final_ln_after_pool or pool_type == "tok"
        grid = image_size // patch_size
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False, device=device)
        self.class_embedding = nn.Parameter(torch.empty(width, device=device))
        self.positional_embedding = nn.Parameter(torch.empty(grid * grid + 1, width, device=device))
        self.patch_dropout = PatchDropout(patch_dropout)
        self.ln_pre = nn.Identity() if no_ln_pre else LayerNorm(width, device=device)
        self.transformer = Transformer(
            width, layers, heads, mlp_ratio, act_layer=act_layer, layer_scale=layer_scale, device=device
        )
        self.ln_post = LayerNorm(width, device=device)
        self.proj = nn.Parameter(torch.empty(width, output_dim, device=device))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.conv1(image.to(self.conv1.weight.dtype))  # [B, width, grid, grid]
        x = x.flatten(2).transpose(1, 2)  # [B, grid*grid, width]
        cls_token = self.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
        x = torch.cat([cls_token, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.patch_dropout(x)
        x = self.ln_pre(x)
        x = self.transformer(x)
        pooled = self.ln_post(self._pool(x)) if self.ln_after_pool else self._pool(self.ln_post(x))
        return pooled.to(self.proj.dtype) @ self.proj

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:].mean(dim=1) if self.pool_type == "avg" else x[:, 0]
