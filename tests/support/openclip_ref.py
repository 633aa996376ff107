"""Import OpenCLIP's real model code as a reference for equivalence tests.

`open_clip_torch` is installed without its dependencies (its torchvision would need a CUDA
torch). Only `open_clip/utils.py` imports torchvision, for a ResNet-only BatchNorm, so when
torchvision cannot be imported we load the package with a placeholder for that one class;
every module that builds ViT CLIP models is OpenCLIP's own, unchanged.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest


def _torchvision_importable() -> bool:
    try:
        import torchvision.ops.misc  # noqa: F401
    except Exception:
        return False
    return True


_PLACEHOLDERS = ("torchvision", "torchvision.ops", "torchvision.ops.misc")


def _placeholder_torchvision() -> None:
    from torch import nn

    class FrozenBatchNorm2d(nn.Module):  # used by OpenCLIP for ResNet towers only
        pass

    for name in _PLACEHOLDERS:
        sys.modules[name] = types.ModuleType(name)
        # A spec, as importlib gives real modules: transformers (which OpenCLIP's hf_model imports
        # when it is installed) asks find_spec("torchvision"), which raises for a module without one;
        # its answer is settled before the placeholder exists (open_clip_model_module).
        sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules["torchvision.ops.misc"].FrozenBatchNorm2d = FrozenBatchNorm2d


def transformers_package():
    """Hugging Face's transformers (bigclip's `hf` extra, in `dev`): skipped without it, failed under CI."""
    try:
        import transformers
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("CI: transformers is not installed (bigclip's hf extra: pip install -e '.[dev]')")
        pytest.skip("transformers is not installed (pip install -e '.[dev]')")
    return transformers


def missing_reference(what: str) -> None:
    """Skip a reference test whose reference is not installed; under CI (`CI` set) fail instead,
    so a reference test never passes by not running."""
    message = f"{what} is not installed (make test installs it: pip install --no-deps open_clip_torch)"
    if os.environ.get("CI"):
        pytest.fail(f"CI: {message}")
    pytest.skip(message)


def _register_open_clip_package() -> None:
    """Register the package `open_clip` without running its __init__ (which imports torchvision)."""
    if "open_clip" in sys.modules:
        return
    spec = importlib.util.find_spec("open_clip")
    if spec is None:
        missing_reference("open_clip_torch (OpenCLIP's own code, the reference)")
    package = types.ModuleType("open_clip")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["open_clip"] = package


def open_clip_model_module():
    """OpenCLIP's `open_clip.model` module (skipped when open_clip is not installed, failed on CI)."""
    if "open_clip.model" in sys.modules:
        return sys.modules["open_clip.model"]
    _register_open_clip_package()
    if _torchvision_importable():
        return importlib.import_module("open_clip.model")
    if importlib.util.find_spec("transformers") is not None:  # OpenCLIP's hf_model imports it
        from transformers.utils import is_torchvision_available

        is_torchvision_available()  # decided (and cached by transformers) while torchvision is absent
    _placeholder_torchvision()
    try:
        return importlib.import_module("open_clip.model")
    finally:  # only for that import: transformers, imported later, must see no torchvision at all
        for name in _PLACEHOLDERS:
            sys.modules.pop(name, None)


def open_clip_tokenizer_module():
    """OpenCLIP's own `open_clip.tokenizer` (needs ftfy, regex, numpy, torch; not torchvision)."""
    _register_open_clip_package()
    return importlib.import_module("open_clip.tokenizer")


def open_clip_pretrained_module():
    """OpenCLIP's `open_clip.pretrained` (its table of pretrained tags; needs tqdm, not torchvision)."""
    _register_open_clip_package()
    return importlib.import_module("open_clip.pretrained")


def open_clip_train_parser():
    """The argparse parser of OpenCLIP's trainer (`open_clip_train.params.parse_args`), unparsed."""
    if importlib.util.find_spec("open_clip_train") is None:
        missing_reference("open_clip_train (installed with open_clip_torch)")
    import argparse
    from unittest import mock

    from open_clip_train import params

    captured = []

    def capture(parser, args=None, namespace=None):
        captured.append(parser)
        raise _Captured

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(_Captured):
        params.parse_args([])
    return captured[0]


class _Captured(Exception):
    pass


def open_clip_config(name: str) -> dict:
    """OpenCLIP's own model config `name` (its package's model_configs/NAME.json; nothing imported)."""
    _register_open_clip_package()
    path = Path(sys.modules["open_clip"].__path__[0]) / "model_configs" / f"{name}.json"
    return json.loads(path.read_text())


def open_clip_config_names() -> list[str]:
    """The names of every model config OpenCLIP's package ships."""
    _register_open_clip_package()
    folder = Path(sys.modules["open_clip"].__path__[0]) / "model_configs"
    return sorted(p.stem for p in folder.glob("*.json"))


def open_clip_clip(name: str, **overrides):
    """OpenCLIP's CLIP for a named config (or bigclip's tiny config, which uses the same schema)."""
    module = open_clip_model_module()
    if name == "tiny":
        from importlib import resources

        cfg = json.loads((resources.files("bigclip.models") / "configs" / "tiny.json").read_text())
    else:
        cfg = open_clip_config(name)
    cfg.update(overrides)
    return module.CLIP(**cfg)
