"""OpenCLIP-compatible CLIP models: plain nn.Modules, OpenCLIP's JSON configs and weight names,
and `build_model(cfg)` (from_config), which applies a run's model options; OpenCLIP's pretrained
tags (pretrained_tags) and `hf-hub:ORG/REPO` files through the Hugging Face cache (hf_hub).
No distributed code. What engines and the linear kinds may use of a model is the model contract
(contract.py): they import nothing else of this package.
May import config, errors and ops (int8/fp8 swaps); never engines, data or train.
"""

from bigclip.models.clip import CLIP, MAX_LOGIT_SCALE, CLIPConfig, init_weights, param_initializers
from bigclip.models.contract import TrainableModel, initial_values, param_generator
from bigclip.models.registry import count_parameters, create_model, get_model_config, list_models

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
