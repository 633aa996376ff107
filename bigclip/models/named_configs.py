"""OpenCLIP's model-config schema and the named configs bigclip bundles (configs/*.json), without torch.

Kept apart from the model code so that checking a run's flags (`--model`, `--force-image-size`,
the tokenizer's context length) imports no torch: a bad flag fails in well under a second.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields
from functools import cache
from importlib import resources

from bigclip.errors import ConfigError
from bigclip.models.hf_hub import hub_config, hub_repo, is_hub_model


@dataclass
class VisionConfig:
    image_size: int = 224
    layers: int = 12
    width: int = 768
    head_width: int = 64
    mlp_ratio: float = 4.0
    patch_size: int = 16


@dataclass
class TextConfig:
    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0


@dataclass
class CLIPConfig:
    """OpenCLIP's model-config schema (the subset that describes ViT CLIP models)."""

    embed_dim: int
    vision_cfg: VisionConfig = field(default_factory=VisionConfig)
    text_cfg: TextConfig = field(default_factory=TextConfig)
    quick_gelu: bool = False
    init_logit_scale: float = math.log(1 / 0.07)
    init_logit_bias: float | None = None


@cache
def _config_files() -> dict[str, str]:
    folder = resources.files("bigclip.models") / "configs"
    return {p.name.removesuffix(".json"): p.read_text() for p in folder.iterdir() if p.name.endswith(".json")}


def list_models() -> list[str]:
    return sorted(_config_files(), key=str.lower)


def _known(cls: type, values: dict, where: str) -> dict:
    names = {f.name for f in fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(
            f"model config {where}: unsupported keys {sorted(unknown)} (bigclip builds ViT CLIP only)"
        )
    return values


def get_model_config(
    name: str,
    *,
    force_quick_gelu: bool = False,
    force_image_size: int = 0,
    force_context_length: int = 0,
    cache_dir: str = "",
) -> CLIPConfig:
    """A named config (or `hf-hub:ORG/REPO`'s `model_cfg`), with OpenCLIP's `force_*` overrides
    (0: keep the config's value). `cache_dir`: the Hugging Face cache for hf-hub names (--cache-dir).

    A changed image size or context length changes the positional embeddings' shapes, as in
    OpenCLIP; weights of the original size then no longer fit (`--pretrained` says which)."""
    raw = _raw_config(name, cache_dir=cache_dir)
    if towers := other_towers(raw):
        raise ConfigError(
            f"model {name!r} needs {' and '.join(towers)}: bigclip builds CLIP models from OpenCLIP's own "
            "ViT image and text transformers (`bigclip models` lists them; a new tower is a model family, "
            "docs/extending.md)"
        )
    vision = VisionConfig(**_known(VisionConfig, raw.pop("vision_cfg", {}), "vision_cfg"))
    text = TextConfig(**_known(TextConfig, raw.pop("text_cfg", {}), "text_cfg"))
    raw.setdefault("quick_gelu", name.endswith("-quickgelu"))
    raw["quick_gelu"] = raw["quick_gelu"] or force_quick_gelu  # OpenAI's weights were trained with it
    vision.image_size = force_image_size or vision.image_size
    text.context_length = force_context_length or text.context_length
    return CLIPConfig(vision_cfg=vision, text_cfg=text, **_known(CLIPConfig, raw, "top level"))


def other_towers(raw: dict) -> list[str]:
    """The towers of an OpenCLIP config that are not OpenCLIP's own ViT and text transformers, by
    the keys OpenCLIP's factory picks a tower class by (a ResNet config would otherwise fail deep
    in the build, its `layers` a list)."""
    vision, text = raw.get("vision_cfg") or {}, raw.get("text_cfg") or {}
    towers = []
    if vision.get("timm_model_name"):
        towers.append(f"timm's {vision['timm_model_name']} image tower")
    elif isinstance(vision.get("layers"), list | tuple):
        towers.append("a ResNet image tower (OpenCLIP's ModifiedResNet)")
    if text.get("hf_model_name"):
        towers.append(f"Hugging Face's {text['hf_model_name']} text tower")
    if "multimodal_cfg" in raw:
        towers.append("CoCa's captioning decoder")
    return towers


def _raw_config(name: str, *, cache_dir: str) -> dict:
    if is_hub_model(name):
        return copy.deepcopy(hub_config(hub_repo(name), cache_dir=cache_dir)["model_cfg"])
    files = _config_files()
    base = name.removesuffix("-quickgelu")
    if base not in files:
        raise ConfigError(
            f"unknown model {name!r}; available: {', '.join(list_models())}, or hf-hub:ORG/REPO "
            "(an OpenCLIP model on the Hugging Face Hub)"
        )
    return json.loads(files[base])
