"""OpenCLIP-compatible CLIP models: plain nn.Modules, OpenCLIP's JSON configs and weight names,
and `build_model(cfg)` (from_config), which applies a run's model options; OpenCLIP's pretrained
tags (pretrained_tags) and `hf-hub:ORG/REPO` files through the Hugging Face cache (hf_hub).
No distributed code.
May import config, errors and ops (int8 swap); never engines, data or train.
"""

from bigclip.models.clip import (
    CLIP,
    MAX_LOGIT_SCALE,
    CLIPConfig,
    init_weights,
    param_generator,
    param_initializers,
)
from bigclip.models.registry import count_parameters, create_model, get_model_config, list_models

__all__ = [
    "CLIP",
    "MAX_LOGIT_SCALE",
    "CLIPConfig",
    "count_parameters",
    "create_model",
    "get_model_config",
    "init_weights",
    "list_models",
    "param_generator",
    "param_initializers",
]
