"""Loading a checkpoint without trusting it: no code runs from it, mismatches are listed.

DCP's stock planner reads every non-tensor value with `torch.load(weights_only=False)`, which
would run code planted in a checkpoint from a shared bucket. Here values go through
`torch.load(weights_only=True)` (ints, floats, strings, lists, dicts, tuples, tensors); the
readers' `.metadata` goes through the restricted unpickler of `bigclip.storage.safe_metadata`.

Before any byte of tensor data is read, the planner compares the requested state with the
checkpoint's metadata and raises one error listing every missing key, every shape mismatch
and the checkpoint's extra keys: loading another model's checkpoint names what differs.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from bigclip.errors import StorageError


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner with `weights_only=True` and an up-front key/shape check.

    `optional_keys`: flattened keys that older checkpoints hold and newer ones do not; when the
    checkpoint lacks one, it is not loaded and its value is left as it was."""

    def __init__(self, *, optional_keys: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.optional_keys = optional_keys

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is not None:
            for key in self.optional_keys:
                if key not in metadata.state_dict_metadata:
                    self.state_dict.pop(key, None)
            check_keys_match(self.state_dict, metadata)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise StorageError(
                f"checkpoint value {fqn!r} is not plain data (weights_only load refused it: {e}); "
                "store ints, floats, strings, lists, dicts or tensors in checkpoint state"
            ) from e
        # This planner always flattens (DCP's default, kept by __init__), so values go through the mappings.
        set_element(self.original_state_dict, self.mappings[fqn], obj)


def check_keys_match(flat_state: dict[str, Any], metadata: Metadata, *, max_listed: int = 20) -> None:
    """Raise StorageError listing missing keys and shape mismatches (extra keys are allowed)."""
    saved = metadata.state_dict_metadata
    missing = sorted(set(flat_state) - set(saved))
    mismatched = [
        f"{key}: checkpoint {tuple(saved[key].size)} vs model {tuple(value.shape)}"
        for key, value in sorted(flat_state.items())
        if key in saved
        and isinstance(value, torch.Tensor)
        and isinstance(saved[key], TensorStorageMetadata)
        and tuple(saved[key].size) != tuple(value.shape)
    ]
    if not (missing or mismatched):
        return
    extra = sorted(set(saved) - set(flat_state))
    lines = ["the checkpoint does not match the state being loaded (is it from another model?)"]
    if missing and not mismatched and all(k.startswith("optim.optimizer.state.") for k in missing):
        # Only Adam state is missing: those weights were frozen when it was saved.
        lines = [
            "the checkpoint holds no optimizer state for some trained parameters: they were frozen "
            "(--lock-image/--lock-text) when it was saved; resume with the same --lock-* options "
            "(or start from its weights with --pretrained)"
        ]
    lines += _listing("missing from the checkpoint", missing, max_listed)
    lines += _listing("shape mismatches", mismatched, max_listed)
    lines += _listing("in the checkpoint but not requested", extra, max_listed)
    raise StorageError("\n".join(lines))


def _listing(title: str, items: list[str], max_listed: int) -> list[str]:
    if not items:
        return []
    shown = [f"    {item}" for item in items[:max_listed]]
    more = [f"    ... and {len(items) - max_listed} more"] if len(items) > max_listed else []
    return [f"  {title} ({len(items)}):", *shown, *more]
