"""Files from the Hugging Face Hub, as OpenCLIP's factory fetches them: `--model hf-hub:ORG/REPO`
and the weights of a `--pretrained` tag.

Every file goes through `huggingface_hub.hf_hub_download`, so its cache and settings apply
unchanged: `HF_HOME` / `HF_HUB_CACHE` (or `--cache-dir`, passed as its `cache_dir`, as OpenCLIP
does), `HF_HUB_OFFLINE=1` (cached files only, no network), tokens and `HF_ENDPOINT`. Weights are
looked for as OpenCLIP looks: the safetensors form first (`open_clip_model.safetensors` for the
default `open_clip_pytorch_model.bin`, `X.safetensors` for `X.bin`/`X.pth`), then the named file.
A repository's `open_clip_config.json` holds `model_cfg` (the model config, OpenCLIP's schema) and
`preprocess_cfg` (image mean/std, interpolation, resize mode).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from bigclip.errors import ConfigError, StorageError

HF_HUB_PREFIX = "hf-hub:"
CONFIG_NAME = "open_clip_config.json"
WEIGHTS_NAME, SAFE_WEIGHTS_NAME = "open_clip_pytorch_model.bin", "open_clip_model.safetensors"


def is_hub_model(name: str) -> bool:
    return name.startswith(HF_HUB_PREFIX)


def hub_repo(name: str) -> str:
    """ORG/REPO of `hf-hub:ORG/REPO`."""
    repo = name[len(HF_HUB_PREFIX) :].strip("/")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ConfigError(f"--model {name}: write a Hugging Face model as hf-hub:ORG/REPO")
    return repo


def hub_file(repo: str, filename: str, *, cache_dir: str = "") -> Path:
    """The local path of REPO's file, from the Hugging Face cache (downloaded into it unless offline)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise ConfigError(
            f"hf-hub:{repo} needs the huggingface_hub package: pip install huggingface_hub"
        ) from e
    try:
        return Path(hf_hub_download(repo, filename, cache_dir=cache_dir or None, library_name="bigclip"))
    except (OSError, ValueError) as e:  # not cached while offline, no such repo or file, no network...
        where = f"--cache-dir {cache_dir}" if cache_dir else "the Hugging Face cache (HF_HOME / HF_HUB_CACHE)"
        raise StorageError(
            f"hf-hub:{repo}: cannot get {filename} ({type(e).__name__}: {str(e)[:400]}). It is looked for in "
            f"{where}; with HF_HUB_OFFLINE=1 only files already there are found: download them where there "
            f"is network (`hf download {repo}`, or one run without HF_HUB_OFFLINE) into the same cache"
        ) from e


def weight_candidates(filename: str) -> list[str]:
    """The names OpenCLIP tries for a weights file, in its order (safetensors first)."""
    if filename == WEIGHTS_NAME:
        return [SAFE_WEIGHTS_NAME, WEIGHTS_NAME]
    if filename.endswith((".bin", ".pth")):
        return [filename[:-4] + ".safetensors", filename]
    return [filename]


def hub_weights(repo: str, filename: str = "", *, cache_dir: str = "") -> Path:
    """REPO's weights: `filename` (default OpenCLIP's), its safetensors form preferred."""
    *preferred, last = weight_candidates(filename or WEIGHTS_NAME)
    for name in preferred:
        try:
            return hub_file(repo, name, cache_dir=cache_dir)
        except StorageError:
            continue  # as OpenCLIP: the safetensors form is optional
    return hub_file(repo, last, cache_dir=cache_dir)


def tag_weights(hf_hub: str, *, cache_dir: str = "") -> Path:
    """The weights a tag's `hf_hub` names: 'org/repo/' (the default file) or 'org/repo/file'."""
    repo, _, filename = hf_hub.rpartition("/")
    return hub_weights(repo, filename, cache_dir=cache_dir)


@cache
def hub_config(repo: str, *, cache_dir: str = "") -> dict:
    """REPO's open_clip_config.json: {"model_cfg": ..., "preprocess_cfg": ...}."""
    path = hub_file(repo, CONFIG_NAME, cache_dir=cache_dir)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StorageError(f"hf-hub:{repo}: {CONFIG_NAME} is not readable JSON ({e})") from e
    if not isinstance(config, dict) or not isinstance(config.get("model_cfg"), dict):
        raise ConfigError(
            f"hf-hub:{repo}: {CONFIG_NAME} has no 'model_cfg' (not an OpenCLIP model repository)"
        )
    return config
