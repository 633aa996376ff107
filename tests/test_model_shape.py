"""The model contract's static half (bigclip/models/shape.py) against the real CLIP: the shape CLIP's
family derives from a config lists exactly the parameters the built model has, its FLOP count is
what torch's FlopCounterMode counts on a forward, and deriving it imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bigclip.errors import ConfigError
from bigclip.models.clip_family import SIGLIP_INIT
from bigclip.models.contract import param_shapes
from bigclip.models.factory import create_model
from bigclip.models.families import model_shape
from bigclip.models.flops import forward_flops
from bigclip.models.named_configs import list_models
from bigclip.models.shape import ModelOptions

VARIANTS = {
    "plain": ModelOptions(),
    "siglip-forced": ModelOptions(loss="siglip", image_size=96, context_length=16, quick_gelu=True),
}


def built(name: str, options: ModelOptions, *, device: str = "meta") -> torch.nn.Module:
    return create_model(
        name, device=device, patch_dropout=options.patch_dropout, force_image_size=options.image_size,
        force_context_length=options.context_length, force_quick_gelu=options.quick_gelu,
        **(SIGLIP_INIT if options.loss == "siglip" else {}),
    )  # fmt: skip


@pytest.mark.parametrize("name", list_models())
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_clips_shape_lists_the_built_models_parameters(name: str, variant: str) -> None:
    options = VARIANTS[variant]
    model, shape = built(name, options), model_shape(name, options)
    assert shape.params == param_shapes(model)
    assert shape.hidden_width == model.hidden_width
    vision, text = model.visual.transformer.resblocks[0], model.transformer.resblocks[0]
    assert (shape.towers["vision"].heads, shape.towers["text"].heads) == (vision.attn.heads, text.attn.heads)


@pytest.mark.parametrize("patch_dropout", [0.0, 0.5])
def test_the_flop_count_is_torchs_count_of_the_forward(patch_dropout: float) -> None:
    """Every matmul, the patch embedding's convolution and attention (SDPA's math form, which
    FlopCounterMode sees as matmuls); patch dropout thins the tokens the blocks see."""
    options = ModelOptions(patch_dropout=patch_dropout)
    model = built("tiny", options, device="cpu").train()
    images, texts = torch.randn(1, 3, 64, 64), torch.randint(1, 1000, (1, 32))
    texts[:, 10] = 49407
    with FlopCounterMode(display=False) as counted, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(images, texts)
    assert forward_flops(model_shape("tiny", options)) == counted.get_total_flops()


def test_an_unknown_name_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown model 'ViT-Q-99'; available: tiny, .*, or hf-hub:ORG/REPO"
    ):
        model_shape("ViT-Q-99")


def test_the_static_shape_and_its_flops_need_no_torch() -> None:
    code = (
        "import sys; from bigclip.models.families import model_shape; from bigclip.models.flops import forward_flops;"
        "shape = model_shape('ViT-bigG-14'); assert forward_flops(shape) > 1e12 and shape.numel > 2e9;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
