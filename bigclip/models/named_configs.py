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
from pathlib import Path

from bigclip.errors import ConfigError
from bigclip.models.hf_hub import hub_config, hub_repo, is_hub_model

# The options of OpenCLIP's HFTokenizer its configs use (bigclip.data.hf_tokenizer applies them).
TOKENIZER_KWARGS = {"clean": ("whitespace", "lower", "canonicalize"), "strip_sep_token": (True, False)}
VISION_POOLS = ("tok", "avg")  # the class token; the mean of the patch tokens (CLIPA)
TEXT_POOLS = ("argmax", "last", "first", "eos")  # the highest id (OpenAI's EOT); a position; eos_id


@dataclass
class VisionConfig:
    image_size: int = 224
    layers: int = 12
    width: int = 768
    head_width: int = 64
    mlp_ratio: float = 4.0
    patch_size: int = 16
    ls_init_value: float | None = None  # LayerScale on each block's two branches
    no_ln_pre: bool = False
    pool_type: str = "tok"
    final_ln_after_pool: bool = False  # ln_post on the pooled features rather than on every token


@dataclass
class TextConfig:
    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0
    ls_init_value: float | None = None
    pool_type: str = "argmax"
    eos_id: int = 2  # the token "eos" pooling reads the features at
    no_causal_mask: bool = False  # bidirectional attention (CLIPA)
    hf_tokenizer_name: str = ""  # the Hugging Face tokenizer the model reads ('': OpenCLIP's BPE)
    tokenizer_kwargs: dict = field(default_factory=dict)  # its cleaning, strip_sep_token


@dataclass
class CLIPConfig:
    """OpenCLIP's model-config schema (the subset that describes ViT CLIP models)."""

    embed_dim: int
    vision_cfg: VisionConfig = field(default_factory=VisionConfig)
    text_cfg: TextConfig = field(default_factory=TextConfig)
    quick_gelu: bool = False
    init_logit_scale: float = math.log(1 / 0.07)
    init_logit_bias: float | None = None


# OpenCLIP's configs whose towers bigclip does not build, with those towers (written by
# benchmarks/openclip_tables.py from the installed OpenCLIP): refused by name, saying why.
OTHER_TOWERS_PATH = Path(__file__).with_name("openclip_other_towers.json")  # for the generator


@cache
def other_tower_configs() -> dict[str, list[str]]:
    return json.loads((resources.files("bigclip.models") / OTHER_TOWERS_PATH.name).read_text())


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
            f"model config {where}: OpenCLIP options bigclip does not build: {sorted(unknown)} (it builds "
            "OpenCLIP's ViT and text transformers with the options of `bigclip models`' configs; "
            "remove the keys or pick one of those models)"
        )
    return values


def _check_tokenizer_kwargs(kwargs: dict, name: str) -> None:
    for key, value in kwargs.items():
        if key not in TOKENIZER_KWARGS:
            raise ConfigError(
                f"model {name!r}: text_cfg.tokenizer_kwargs {key!r} is not applied by bigclip; it applies "
                f"{', '.join(TOKENIZER_KWARGS)}"
            )
        if value not in TOKENIZER_KWARGS[key]:
            raise ConfigError(
                f"model {name!r}: text_cfg.tokenizer_kwargs {key} {value!r}: use one of "
                f"{', '.join(map(str, TOKENIZER_KWARGS[key]))}"
            )


def _check_pools(vision: VisionConfig, text: TextConfig, name: str) -> None:
    for where, pool, pools in (
        ("vision_cfg", vision.pool_type, VISION_POOLS),
        ("text_cfg", text.pool_type, TEXT_POOLS),
    ):
        if pool not in pools:
            raise ConfigError(
                f"model {name!r}: {where}.pool_type {pool!r} is not one bigclip builds; use one of {', '.join(pools)}"
            )


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
    refuse_other_towers(name)
    raw = _raw_config(name, cache_dir=cache_dir)
    refuse_other_towers(name, raw)
    vision = VisionConfig(**_known(VisionConfig, raw.pop("vision_cfg", {}), "vision_cfg"))
    text = TextConfig(**_known(TextConfig, raw.pop("text_cfg", {}), "text_cfg"))
    _check_pools(vision, text, name)
    _check_tokenizer_kwargs(text.tokenizer_kwargs, name)
    raw.setdefault("quick_gelu", name.endswith("-quickgelu"))
    raw["quick_gelu"] = raw["quick_gelu"] or force_quick_gelu  # OpenAI's weights were trained with it
    vision.image_size = force_image_size or vision.image_size
    text.context_length = force_context_length or text.context_length
    return CLIPConfig(vision_cfg=vision, text_cfg=text, **_known(CLIPConfig, raw, "top level"))


def refuse_other_towers(name: str, raw: dict | None = None) -> None:
    """A ConfigError naming the towers bigclip does not build, for one of OpenCLIP's configs of such
    towers (by name) or a config (`raw`, e.g. an hf-hub model's) with them."""
    towers = (
        other_towers(raw) if raw is not None else other_tower_configs().get(name.removesuffix("-quickgelu"))
    )
    if towers:
        raise ConfigError(
            f"model {name!r} needs {' and '.join(towers)}: bigclip builds CLIP models from OpenCLIP's own "
            "ViT image and text transformers (`bigclip models` lists them; a new tower is a model family, "
            "docs/extending.md)"
        )


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
