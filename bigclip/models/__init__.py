"""OpenCLIP-compatible CLIP models. Plain nn.Modules: no distributed code lives here."""

from bigclip.models.clip import CLIP, CLIPConfig, init_weights, param_generator, param_initializers
from bigclip.models.registry import count_parameters, create_model, get_model_config, list_models

__all__ = [
    "CLIP",
    "CLIPConfig",
    "count_parameters",
    "create_model",
    "get_model_config",
    "init_weights",
    "list_models",
    "param_generator",
    "param_initializers",
]
