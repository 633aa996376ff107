"""What OpenCLIP's names for weights resolve to: `--pretrained TAG` for a bundled model, and the
weights and preprocessing of `--model hf-hub:ORG/REPO`. The CLIP family's `named_weights` module
(models/shape.py): a run reaches it through the family (weights/pretrained.py).

    python -m bigclip.train --model ViT-B-32 --pretrained laion2b_s34b_b79k ...
    python -m bigclip.train --model hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K ...

A tag's entry (models/pretrained_tags.json, OpenCLIP's table) names a Hugging Face file, fetched
through huggingface_hub's cache (models/hf_hub.py: HF_HOME, HF_HUB_OFFLINE, --cache-dir); the file
is then read like any other `--pretrained` file. As in OpenCLIP:
- the image mean/std of the tag (or of the repository's `preprocess_cfg`) normalise the images
  unless --image-mean/--image-std are given; they are written into the run's config, so the saved
  config says what the run used;
- a tag trained with QuickGELU on a model without it (`--model ViT-B-32 --pretrained openai`)
  is a warning, not an error (OpenCLIP's factory warns and builds the model asked for): use the
  `-quickgelu` model or --force-quick-gelu;
- `hf-hub:ORG/REPO` brings its own weights, loaded when --pretrained is not given. Unlike
  OpenCLIP, which ignores --pretrained for hf-hub models, an explicit path or URI replaces them.
Evaluation's --image-interpolation/--image-resize-mode are checked against the weights' and a
difference is logged with the flag that matches them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from bigclip.config import ModelConfig, TrainConfig
from bigclip.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from bigclip.models.factory import get_model_config
from bigclip.models.hf_hub import hub_config, hub_repo, hub_weights, is_hub_model, tag_weights
from bigclip.models.pretrained_tags import get_tag

OPENCLIP_PREPROCESS = {  # OpenCLIP's PreprocessCfg defaults, under what a tag or repository says
    "mean": list(OPENAI_CLIP_MEAN),
    "std": list(OPENAI_CLIP_STD),
    "interpolation": "bicubic",
    "resize_mode": "shortest",
}


@dataclass
class Preprocess:
    """The preprocessing the named weights were trained with, and which name said so."""

    source: str  # e.g. "--pretrained laion2b_s34b_b79k"
    values: dict = field(default_factory=lambda: dict(OPENCLIP_PREPROCESS))
    quick_gelu: bool | None = None  # a tag's QuickGELU (None: the model config says)


def preprocess_of(model: ModelConfig) -> Preprocess | None:
    """What a tag or an hf-hub repository records (None for weights given by path or URI)."""
    if is_hub_model(model.model):
        saved = hub_config(hub_repo(model.model), cache_dir=model.cache_dir).get("preprocess_cfg") or {}
        return Preprocess(f"--model {model.model}", _merged(saved))
    entry = get_tag(model.model, model.pretrained) if model.pretrained else None
    if entry is None:
        return None
    return Preprocess(f"--pretrained {model.pretrained}", _merged(entry), bool(entry.get("quick_gelu")))


def _merged(saved: dict) -> dict:
    out = dict(OPENCLIP_PREPROCESS)
    for key in out:
        value = saved.get(key)
        if value is not None:
            out[key] = list(value) if isinstance(value, list | tuple) else value
    return out


def weights_of(model: ModelConfig) -> tuple[str, str] | None:
    """(the file or URL to read, how messages name it) for a tag or an hf-hub model's own weights;
    None when --pretrained is a path or URI. Fetches through the Hugging Face cache."""
    if is_hub_model(model.model):
        if model.pretrained:
            return None  # an explicit path or URI replaces the repository's weights
        return str(hub_weights(hub_repo(model.model), cache_dir=model.cache_dir)), model.model
    entry = get_tag(model.model, model.pretrained) if model.pretrained else None
    if entry is None:
        return None
    label = f"{model.pretrained} ({model.model})"
    if entry.get("hf_hub"):
        return str(tag_weights(entry["hf_hub"], cache_dir=model.cache_dir)), label
    return entry["url"], label  # downloaded into bigclip's cache like any https:// weights


def apply_preprocess(cfg: TrainConfig, log: logging.Logger) -> None:
    """Use the named weights' mean/std unless --image-mean/--image-std say otherwise; warn about a
    QuickGELU or evaluation-resize mismatch. Every rank runs it (it changes the run's config)."""
    found = preprocess_of(cfg.model)
    if found is None:
        return
    values, data = found.values, cfg.data
    if not data.image_mean:
        data.image_mean = list(values["mean"])
    if not data.image_std:
        data.image_std = list(values["std"])
    for flag, key, ours in (("--image-interpolation", "interpolation", data.image_interpolation),
                            ("--image-resize-mode", "resize_mode", data.image_resize_mode)):  # fmt: skip
        if values[key] != ours:
            log.warning(
                f"{found.source} was trained with {key} {values[key]!r}; evaluation uses {ours!r} "
                f"(pass {flag} {values[key]} for OpenCLIP's preprocessing)"
            )
    if found.quick_gelu is not None:
        built = get_model_config(cfg.model.model, force_quick_gelu=cfg.model.force_quick_gelu).quick_gelu
        if built != found.quick_gelu:
            fix = f"--model {cfg.model.model}-quickgelu or --force-quick-gelu" if found.quick_gelu else (
                f"--model {cfg.model.model.removesuffix('-quickgelu')} without --force-quick-gelu")  # fmt: skip
            log.warning(
                f"QuickGELU mismatch: --model {cfg.model.model} builds quick_gelu={built}, but {found.source} "
                f"was trained with quick_gelu={found.quick_gelu} (as OpenCLIP, training goes on; use {fix})"
            )
