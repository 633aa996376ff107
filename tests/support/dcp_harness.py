"""Read a DCP checkpoint the reference way (torch's own dcp_to_torch_save), for comparisons."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def whole_checkpoint(folder: Path) -> dict:
    """A DCP checkpoint read back as full tensors, flattened to 'a.b.c' keys (list items by index)."""
    target = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(folder, target)
    flat: dict = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, list):
            for k, v in enumerate(value):
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    walk("", torch.load(target, weights_only=False))
    return flat
