"""OpenCLIP's pretrained tags (`--pretrained laion2b_s34b_b79k`) for the models bigclip bundles.

`pretrained_tags.json` is OpenCLIP 3.3.0's own table (`open_clip/pretrained.py`), restricted to
bigclip's models and their `-quickgelu` variants, unchanged: for each tag the Hugging Face file
(`hf_hub`: "org/repo/" for the repository's default weights file, or "org/repo/file") and/or a
URL, the image mean/std, interpolation and resize mode its weights were trained with, and
`quick_gelu` where the weights need QuickGELU. It is data, written by
benchmarks/openclip_tables.py; tests/test_pretrained_tags.py compares it with OpenCLIP's.
Tags are matched as OpenCLIP matches them: case-insensitively, '-' read as '_'.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

from bigclip.errors import ConfigError
from bigclip.models.named_configs import list_models, refuse_other_towers

TABLE_PATH = Path(__file__).with_name("pretrained_tags.json")  # for the generator; read through resources
QUICKGELU = "-quickgelu"


@cache
def _table() -> dict[str, dict[str, dict]]:
    return json.loads((resources.files("bigclip.models") / TABLE_PATH.name).read_text())


def bundled_tag_models() -> list[str]:
    """The model names whose OpenCLIP tags bigclip ships: each bundled config and its -quickgelu form."""
    return [f"{name}{suffix}" for name in list_models() for suffix in ("", QUICKGELU)]


def clean_tag(tag: str) -> str:
    return tag.lower().replace("-", "_")  # OpenCLIP's `_clean_tag`


def tags_for(model: str) -> list[str]:
    return list(_table().get(model, {}))


def models_with(tag: str) -> list[str]:
    return [model for model, tags in _table().items() if clean_tag(tag) in tags]


def get_tag(model: str, tag: str) -> dict | None:
    """The table entry of `tag` for `model`, or None when `model` has no such tag."""
    entry = _table().get(model, {}).get(clean_tag(tag))
    return dict(entry) if entry is not None else None


def looks_like_tag(value: str) -> bool:
    """A bare name: not a URI (s3://, https://, registry:), a path with folders, or a weights file name."""
    return (
        bool(value)
        and not any(c in value for c in "/:\\")
        and not value.endswith((".pt", ".pth", ".bin", ".safetensors", ".json", ".npz"))
    )


def unknown_tag(model: str, tag: str) -> ConfigError:
    """The error for a tag `model` does not have, naming the tags it has and the models with `tag`."""
    known = tags_for(model)
    has = f"its tags: {', '.join(known)}" if known else "bigclip knows no OpenCLIP tags for it"
    elsewhere = models_with(tag)
    where = f"; {tag!r} is a tag of {', '.join(elsewhere)} (pass that --model)" if elsewhere else ""
    return ConfigError(
        f"--pretrained {tag!r}: --model {model} has no such OpenCLIP tag and there is no such file or folder "
        f"({model}: {has}){where}. Give one of its tags, or a path, s3://, https:// or registry:NAME"
    )


def tag_hint(pretrained: str) -> str:
    """For an unknown --model's message: which models have --pretrained's tag ('' for no tag)."""
    if not looks_like_tag(pretrained) or Path(pretrained).exists():
        return ""
    return f"; the OpenCLIP tag {pretrained!r} is known for {', '.join(models_with(pretrained)) or 'none of them'}"


def check_pretrained(model: str, pretrained: str) -> None:
    """Fail at parse time for a bare name that is no tag of --model and no file or folder here."""
    if not looks_like_tag(pretrained) or Path(pretrained).exists():
        return
    if model.startswith("hf-hub:"):  # (checked before the repository's config is looked for)
        raise ConfigError(
            f"--pretrained {pretrained!r}: OpenCLIP tags name weights of bigclip's bundled models; --model "
            f"{model} brings its own weights (drop --pretrained to use them, or give a path or URI)"
        )
    refuse_other_towers(model)
    if get_tag(model, pretrained) is None:
        raise unknown_tag(model, pretrained)
