"""CLIP: an image tower and a text tower projected into a shared embedding space.

The module is plain PyTorch: it knows nothing of sharding or precision policies. Weights
are initialised by `init_weights`, parameter by parameter, from a generator seeded by the
parameter's name, so a sharded engine can initialise its shard of each tensor and obtain
exactly the values an unsharded model would have (see `param_initializers`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bigclip.models.contract import InitFn, LinearSlot, ScalarRange, initial_values
from bigclip.models.named_configs import CLIPConfig, TextConfig, VisionConfig  # noqa: F401 (re-exported)
from bigclip.models.text import build_text_modules, pool_text
from bigclip.models.transformer import QuickGELU, block_linears
from bigclip.models.vision import VisionTransformer

# OpenCLIP's trainer clamps logit_scale to [0, ln 100] after every step (a temperature of 1/100).
MAX_LOGIT_SCALE = math.log(100)


class CLIP(nn.Module):
    def __init__(
        self, cfg: CLIPConfig, *, patch_dropout: float = 0.0, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        act = QuickGELU if cfg.quick_gelu else nn.GELU
        v, t = cfg.vision_cfg, cfg.text_cfg
        self.visual = VisionTransformer(
            image_size=v.image_size,
            patch_size=v.patch_size,
            width=v.width,
            layers=v.layers,
            heads=v.width // v.head_width,
            mlp_ratio=v.mlp_ratio,
            output_dim=cfg.embed_dim,
            patch_dropout=patch_dropout,
            act_layer=act,
            layer_scale=v.ls_init_value is not None,
            no_ln_pre=v.no_ln_pre,
            pool_type=v.pool_type,
            final_ln_after_pool=v.final_ln_after_pool,
            device=device,
        )
        text = build_text_modules(
            context_length=t.context_length,
            vocab_size=t.vocab_size,
            width=t.width,
            heads=t.heads,
            layers=t.layers,
            mlp_ratio=t.mlp_ratio,
            output_dim=cfg.embed_dim,
            act_layer=act,
            layer_scale=t.ls_init_value is not None,
            device=device,
        )
        for name, module in text.items():
            setattr(self, name, module)
        self.logit_scale = nn.Parameter(torch.empty((), device=device))
        self.logit_bias = (
            nn.Parameter(torch.empty((), device=device)) if cfg.init_logit_bias is not None else None
        )

    @property
    def context_length(self) -> int:
        return self.cfg.text_cfg.context_length

    @property
    def image_size(self) -> int:
        return self.cfg.vision_cfg.image_size

    # The model contract (models/contract.py): all that engines and linear kinds use.

    def blocks(self) -> list[nn.Module]:
        """Residual blocks of both towers: the units engines shard, checkpoint and compile."""
        return [*self.visual.transformer.resblocks, *self.transformer.resblocks]

    def param_initializers(self) -> dict[str, InitFn]:
        return param_initializers(self)

    @property
    def input_dtype(self) -> torch.dtype:
        return self.visual.conv1.weight.dtype

    @property
    def hidden_width(self) -> int:
        return max(self.cfg.vision_cfg.width, self.cfg.text_cfg.width)

    def replicated_scalars(self) -> dict[str, ScalarRange]:
        """OpenCLIP's logit scale, clamped to [0, log 100] after each step, and SigLIP's bias."""
        return {"logit_scale": (0.0, MAX_LOGIT_SCALE)} | (
            {"logit_bias": (None, None)} if self.logit_bias is not None else {}
        )

    def swappable_linears(self) -> list[LinearSlot]:
        """Per block: the MLP's c_fc and c_proj, the attention's fused QKV and output projection."""
        names = {id(module): name for name, module in self.named_modules()}
        return [slot for block in self.blocks() for slot in block_linears(names[id(block)], block)]

    def set_grad_checkpointing(self, enable: bool = True, *, every: int = 1, policy: str = "full") -> None:
        """OpenCLIP's switch, plus bigclip's selective options (see bigclip.models.activation_checkpointing)."""
        self.visual.transformer.set_grad_checkpointing(enable, every=every, policy=policy)
        self.transformer.set_grad_checkpointing(enable, every=every, policy=policy)

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.visual(image)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        x = self.token_embedding(text) + self.positional_embedding[: text.shape[1]]
        t = self.cfg.text_cfg
        x = self.transformer(x, causal=not t.no_causal_mask)
        # LayerNorm is per token: pooling before ln_final is equivalent to OpenCLIP's order, and cheaper.
        pooled = self.ln_final(pool_text(x, text, t.pool_type, t.eos_id))
        features = pooled.to(self.text_projection.dtype) @ self.text_projection
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, image: torch.Tensor | None = None, text: torch.Tensor | None = None) -> dict:
        """Normalised features and the (exponentiated) logit scale, as OpenCLIP's output_dict."""
        out = {
            "image_features": self.encode_image(image, normalize=True) if image is not None else None,
            "text_features": self.encode_text(text, normalize=True) if text is not None else None,
            "logit_scale": self.logit_scale.exp(),
        }
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        return out


def _normal(std: float) -> InitFn:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def _constant(value: float) -> InitFn:
    return lambda t, g: t.fill_(value)


def _uniform_fan_in(fan_in: int) -> InitFn:
    # nn.Linear / nn.Conv2d default: kaiming_uniform(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1.0 / math.sqrt(fan_in)
    return lambda t, g: t.uniform_(-bound, bound, generator=g)


def _block_rules(prefix: str, width: int, layers: int, ls_init_value: float | None) -> dict[str, InitFn]:
    """OpenCLIP's text-tower init, used for both towers (its vision init is torch's defaults);
    LayerScale gains start at the config's `ls_init_value`."""
    attn_std = width**-0.5
    proj_std = attn_std * (2 * layers) ** -0.5
    fc_std = (2 * width) ** -0.5
    rules: dict[str, InitFn] = {}
    for i in range(layers):
        p = f"{prefix}.resblocks.{i}."
        rules |= {
            p + "ln_1.weight": _constant(1.0),
            p + "ln_1.bias": _constant(0.0),
            p + "ln_2.weight": _constant(1.0),
            p + "ln_2.bias": _constant(0.0),
            p + "attn.in_proj_weight": _normal(attn_std),
            p + "attn.in_proj_bias": _constant(0.0),
            p + "attn.out_proj.weight": _normal(proj_std),
            p + "attn.out_proj.bias": _constant(0.0),
            p + "mlp.c_fc.weight": _normal(fc_std),
            p + "mlp.c_fc.bias": _constant(0.0),
            p + "mlp.c_proj.weight": _normal(proj_std),
            p + "mlp.c_proj.bias": _constant(0.0),
        }
        if ls_init_value is not None:
            rules |= {p + "ls_1.gamma": _constant(ls_init_value), p + "ls_2.gamma": _constant(ls_init_value)}
    return rules


def param_initializers(model: CLIP) -> dict[str, InitFn]:
    """For every parameter name, a function that fills a full-size tensor with its initial values."""
    cfg = model.cfg
    v, t = cfg.vision_cfg, cfg.text_cfg
    scale = v.width**-0.5
    rules: dict[str, InitFn] = {
        "visual.conv1.weight": _uniform_fan_in(3 * v.patch_size**2),
        "visual.class_embedding": _normal(scale),
        "visual.positional_embedding": _normal(scale),
        "visual.ln_pre.weight": _constant(1.0),
        "visual.ln_pre.bias": _constant(0.0),
        "visual.ln_post.weight": _constant(1.0),
        "visual.ln_post.bias": _constant(0.0),
        "visual.proj": _normal(scale),
        "token_embedding.weight": _normal(0.02),
        "positional_embedding": _normal(0.01),
        "ln_final.weight": _constant(1.0),
        "ln_final.bias": _constant(0.0),
        "text_projection": _normal(t.width**-0.5),
        "logit_scale": _constant(cfg.init_logit_scale),
    }
    if cfg.init_logit_bias is not None:
        rules["logit_bias"] = _constant(cfg.init_logit_bias)
    rules |= _block_rules("visual.transformer", v.width, v.layers, v.ls_init_value)
    rules |= _block_rules("transformer", t.width, t.layers, t.ls_init_value)
    return rules


@torch.no_grad()
def init_weights(model: CLIP, *, seed: int = 0) -> CLIP:
    """Initialise an unsharded, materialised model in place."""
    params = dict(model.named_parameters())
    for name, full in initial_values(model, {n: p.shape for n, p in params.items()}, seed=seed, device="cpu"):
        params[name].copy_(full)
    return model
