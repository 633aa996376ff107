"""Model configs (OpenCLIP's JSON schema) and the `create_model` factory."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from functools import cache
from importlib import resources

import torch

from bigclip.errors import ConfigError
from bigclip.models.clip import CLIP, CLIPConfig, TextConfig, VisionConfig, init_weights
from bigclip.models.hf_hub import hub_config, hub_repo, is_hub_model


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
    vision = VisionConfig(**_known(VisionConfig, raw.pop("vision_cfg", {}), "vision_cfg"))
    text = TextConfig(**_known(TextConfig, raw.pop("text_cfg", {}), "text_cfg"))
    raw.setdefault("quick_gelu", name.endswith("-quickgelu"))
    raw["quick_gelu"] = raw["quick_gelu"] or force_quick_gelu  # OpenAI's weights were trained with it
    vision.image_size = force_image_size or vision.image_size
    text.context_length = force_context_length or text.context_length
    return CLIPConfig(vision_cfg=vision, text_cfg=text, **_known(CLIPConfig, raw, "top level"))


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


def create_model(
    name: str,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype | None = None,
    patch_dropout: float = 0.0,
    init_logit_bias: float | None = None,
    init_logit_scale: float | None = None,
    seed: int = 0,
    cache_dir: str = "",
    **forced: int | bool,
) -> CLIP:
    """Build a CLIP by config name.

    On the meta device nothing is allocated (ViT-bigG-14 builds in well under a second) and
    weights are left for the engine to initialise after sharding. On a real device the
    weights are initialised here with `init_weights(seed=seed)`. `forced`: `get_model_config`'s
    force_* overrides.
    """
    cfg = get_model_config(name, cache_dir=cache_dir, **forced)  # and force_quick_gelu, _image_size, ...
    if init_logit_bias is not None:
        cfg.init_logit_bias = init_logit_bias
    if init_logit_scale is not None:
        cfg.init_logit_scale = init_logit_scale
    model = CLIP(cfg, patch_dropout=patch_dropout, device=device)
    if torch.device(device).type != "meta":
        init_weights(model, seed=seed)
    if dtype is not None:
        model.to(dtype)
    return model


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts in OpenCLIP's split: total, image tower, text tower (the rest)."""
    total = sum(p.numel() for p in model.parameters())
    image = sum(p.numel() for p in model.visual.parameters())
    return {"total": total, "image": image, "text": total - image}


def main(argv: list[str]) -> int:
    print(f"{'model':<14}{'params (M)':>12}{'image (M)':>12}{'text (M)':>12}")
    for name in list_models():
        counts = count_parameters(create_model(name, device="meta"))
        print(f"{name:<14}" + "".join(f"{counts[k] / 1e6:>12.2f}" for k in ("total", "image", "text")))
    return 0
