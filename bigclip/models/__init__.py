"""OpenCLIP-compatible CLIP models: plain nn.Modules, OpenCLIP's JSON configs and weight names,
and `build_model(cfg)` (from_config), which applies a run's model options; OpenCLIP's pretrained
tags (pretrained_tags) and `hf-hub:ORG/REPO` files through the Hugging Face cache (hf_hub).
No distributed code. What engines and the linear kinds may use of a model is the model contract
(contract.py): they import nothing else of this package. The planner and consolidation use its
static half, without torch: a model family's `ModelShape` (shape.py, families.py) and the FLOP
count derived from it (flops.py).
May import config, errors and ops (int8/fp8 swaps); never engines, data or train.

The names below load on first use (PEP 562), so `bigclip.models.named_configs` (the configs,
without torch) can be imported by the flag checks without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "CLIP": "clip",
    "MAX_LOGIT_SCALE": "clip",
    "init_weights": "clip",
    "param_generator": "contract",
    "param_initializers": "clip",
    "TrainableModel": "contract",
    "initial_values": "contract",
    "CLIPConfig": "named_configs",
    "get_model_config": "named_configs",
    "list_models": "named_configs",
    "count_parameters": "factory",
    "create_model": "factory",
}
__all__ = [
    "CLIP",
    "MAX_LOGIT_SCALE",
    "CLIPConfig",
    "count_parameters",
    "create_model",
    "get_model_config",
    "TrainableModel",
    "init_weights",
    "initial_values",
    "list_models",
    "param_generator",
    "param_initializers",
]

if TYPE_CHECKING:
    from bigclip.models.clip import CLIP, MAX_LOGIT_SCALE, init_weights, param_initializers
    from bigclip.models.contract import TrainableModel, initial_values, param_generator
    from bigclip.models.factory import count_parameters, create_model
    from bigclip.models.named_configs import CLIPConfig, get_model_config, list_models


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'bigclip.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bigclip.models.{_WHERE[name]}"), name)
