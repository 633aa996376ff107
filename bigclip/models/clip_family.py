"""CLIP as the static contract sees it (models/shape.py): the shape and the OpenCLIP config of a
named config, from the config alone (no torch, no model). Parameter names, order and shapes are
those `CLIP` (clip.py) registers; tests/test_model_shape.py holds the two together.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bigclip.errors import ConfigError
from bigclip.models.hf_hub import is_hub_model
from bigclip.models.named_configs import CLIPConfig, get_model_config, list_models, other_tower_configs
from bigclip.models.pretrained_tags import check_pretrained, tag_hint
from bigclip.models.shape import ModelFamily, ModelOptions, ModelShape, ParamShape, TowerShape

SIGLIP_INIT = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0}  # OpenCLIP's SigLIP init
FP32_BYTES, TOKEN_BYTES = 4, 8  # the pixels the loader hands the model; int64 token ids


def kept_patches(num_patches: int, prob: float) -> int:
    """Patches a patch-dropout rate keeps per image (at least one)."""
    return max(1, int(num_patches * (1.0 - prob))) if prob else num_patches


def clip_config(name: str, options: ModelOptions) -> CLIPConfig:
    """The named config with the run's --force-* options and its loss's logit-bias init applied."""
    cfg = get_model_config(
        name, force_quick_gelu=options.quick_gelu, force_image_size=options.image_size,
        force_context_length=options.context_length, cache_dir=options.cache_dir,
    )  # fmt: skip
    if options.loss == "siglip":
        cfg.init_logit_bias = SIGLIP_INIT["init_logit_bias"]
    return cfg


def owns_name(name: str) -> bool:
    """Its configs, hf-hub models, and OpenCLIP's configs of other towers (its check refuses those,
    naming the towers)."""
    base = name.removesuffix("-quickgelu")
    return is_hub_model(name) or base in list_models() or base in other_tower_configs()


def _block_params(
    prefix: str, *, width: int, mlp: int, layers: int, first: int, layer_scale: bool
) -> list[ParamShape]:
    """One `ResidualAttentionBlock` per layer (transformer.py), blocks numbered from `first`."""
    ls_1, ls_2 = ({"ls_1.gamma": (width,)}, {"ls_2.gamma": (width,)}) if layer_scale else ({}, {})
    shapes = {
        "ln_1.weight": (width,), "ln_1.bias": (width,),
        "attn.in_proj_weight": (3 * width, width), "attn.in_proj_bias": (3 * width,),
        "attn.out_proj.weight": (width, width), "attn.out_proj.bias": (width,), **ls_1,
        "ln_2.weight": (width,), "ln_2.bias": (width,),
        "mlp.c_fc.weight": (mlp, width), "mlp.c_fc.bias": (mlp,),
        "mlp.c_proj.weight": (width, mlp), "mlp.c_proj.bias": (width,), **ls_2,
    }  # fmt: skip
    return [
        ParamShape(f"{prefix}.resblocks.{i}.{n}", s, first + i)
        for i in range(layers)
        for n, s in shapes.items()
    ]


def _root(*named: tuple[str, tuple[int, ...]]) -> list[ParamShape]:
    return [ParamShape(n, s, -1) for n, s in named]


def clip_params(cfg: CLIPConfig) -> tuple[ParamShape, ...]:
    """CLIP's parameters in `named_parameters()` order (OpenCLIP's state-dict order): each module's
    own parameters before its submodules', so the root's (the text tower's embeddings and
    projection, OpenCLIP keeps them there; the logit scale and SigLIP's bias) come first."""
    v, t, d = cfg.vision_cfg, cfg.text_cfg, cfg.embed_dim
    grid = v.image_size // v.patch_size
    vw, tw = v.width, t.width
    bias = [("logit_bias", ())] if cfg.init_logit_bias is not None else []
    ln_pre = [] if v.no_ln_pre else [("visual.ln_pre.weight", (vw,)), ("visual.ln_pre.bias", (vw,))]
    return tuple(
        _root(("positional_embedding", (t.context_length, tw)), ("text_projection", (tw, d)), ("logit_scale", ()),
              *bias, ("visual.class_embedding", (vw,)), ("visual.positional_embedding", (grid * grid + 1, vw)),
              ("visual.proj", (vw, d)), ("visual.conv1.weight", (vw, 3, v.patch_size, v.patch_size)), *ln_pre)
        + _block_params("visual.transformer", width=vw, mlp=int(vw * v.mlp_ratio), layers=v.layers, first=0,
                        layer_scale=v.ls_init_value is not None)
        + _root(("visual.ln_post.weight", (vw,)), ("visual.ln_post.bias", (vw,)))
        + _block_params("transformer", width=tw, mlp=int(tw * t.mlp_ratio), layers=t.layers, first=v.layers,
                        layer_scale=t.ls_init_value is not None)
        + _root(("token_embedding.weight", (t.vocab_size, tw)), ("ln_final.weight", (tw,)), ("ln_final.bias", (tw,)))
    )  # fmt: skip


def clip_towers(cfg: CLIPConfig, *, patch_dropout: float) -> dict[str, TowerShape]:
    """The vision tower sees the class token and the patches patch dropout keeps, and saves ln_pre's
    input and its last block's output (ln_post reads the class token through a view of it); its
    patch embedding sees every patch. Each tower projects its width into the embed dim."""
    v, t, d = cfg.vision_cfg, cfg.text_cfg, cfg.embed_dim
    patches = (v.image_size // v.patch_size) ** 2
    vision = TowerShape(
        v.layers, v.width, int(v.width * v.mlp_ratio), v.width // v.head_width,
        tokens=1 + kept_patches(patches, patch_dropout), saved_outside=2 * v.width,
        input_bytes=3 * v.image_size**2 * FP32_BYTES,
        outside_flops=2 * 3 * v.patch_size**2 * v.width * patches + 2 * v.width * d,
    )  # fmt: skip
    text = TowerShape(
        t.layers, t.width, int(t.width * t.mlp_ratio), t.heads, tokens=t.context_length,
        input_bytes=t.context_length * TOKEN_BYTES, outside_flops=2 * t.width * d,
    )  # fmt: skip
    return {"vision": vision, "text": text}


def clip_shape(name: str, options: ModelOptions) -> ModelShape:
    cfg = clip_config(name, options)
    return ModelShape(
        towers=clip_towers(cfg, patch_dropout=options.patch_dropout),
        params=clip_params(cfg),
        embed_dim=cfg.embed_dim,
        image_size=cfg.vision_cfg.image_size,
    )


def clip_tokenizer(name: str, options: ModelOptions) -> dict[str, Any]:
    t = clip_config(name, options).text_cfg
    return {"context_length": t.context_length, "vocab_size": t.vocab_size, "text_pool": t.pool_type,
            "eos_id": t.eos_id, "hf_name": t.hf_tokenizer_name, "hf_kwargs": t.tokenizer_kwargs}  # fmt: skip


def check_clip_flags(model: Any) -> None:  # a ModelConfig (shape.py says why Any)
    """An unknown --pretrained tag (naming the tags the model has), an image size below the patch."""
    check_pretrained(model.model, model.pretrained)
    vision = get_model_config(model.model, cache_dir=model.cache_dir).vision_cfg  # raises for other towers
    size = model.force_image_size
    if size and size[0] < vision.patch_size:
        raise ConfigError(
            f"--force-image-size {size[0]} is below {model.model}'s patch size {vision.patch_size}"
        )


def open_clip_model_config(name: str, options: ModelOptions) -> dict[str, Any]:
    """OpenCLIP's `model_cfg` for the name: its initial logit scale left out (the weights hold the
    trained one), and the keys OpenCLIP leaves out when unset (None, False)."""
    out = dataclasses.asdict(clip_config(name, options))
    out.pop("init_logit_scale")

    def set_only(d: dict[str, Any]) -> dict[str, Any]:
        return {
            k: set_only(v) if isinstance(v, dict) else v
            for k, v in d.items()
            if v is not None and v is not False
        }

    return set_only(out)


CLIP_FAMILY = ModelFamily(
    name="clip",
    configs=list_models,
    owns=owns_name,
    shape=clip_shape,
    build="bigclip.models.factory:build_clip",
    tokenizer=clip_tokenizer,
    check=check_clip_flags,
    open_clip_config=open_clip_model_config,
    other_names="hf-hub:ORG/REPO (an OpenCLIP model on the Hugging Face Hub)",
    named_weights="bigclip.weights.named",
    has_own_weights=is_hub_model,  # an hf-hub:ORG/REPO repository holds its weights
    pretrained_hint=tag_hint,
)
