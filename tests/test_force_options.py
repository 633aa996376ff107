"""--force-quick-gelu, --force-image-size and --force-context-length build what OpenCLIP builds."""

import json
from importlib import resources

import pytest
import torch
from support.openclip_ref import open_clip_model_module

from bigclip.cli_args import parse_train_args
from bigclip.errors import ConfigError
from bigclip.models.clip_family import clip_config
from bigclip.models.from_config import build_model, synthetic_batch
from bigclip.models.run_options import model_options
from bigclip.models.transformer import QuickGELU

FORCES = ["--force-quick-gelu", "--force-image-size", "48", "--force-context-length", "20"]


def openclip_forced_tiny():
    """What OpenCLIP's create_model(force_quick_gelu, force_image_size, force_context_length) does
    to a model config before building its CLIP."""
    cfg = json.loads((resources.files("bigclip.models") / "configs" / "tiny.json").read_text())
    cfg["quick_gelu"] = True
    cfg["vision_cfg"]["image_size"] = 48
    cfg["text_cfg"]["context_length"] = 20
    return open_clip_model_module().CLIP(**cfg)


def test_forced_model_equals_openclips_forced_model():
    cfg = parse_train_args(["--model", "tiny", *FORCES])
    forced = clip_config(cfg.model.model, model_options(cfg))
    assert (forced.vision_cfg.image_size, forced.text_cfg.context_length) == (48, 20)
    torch.manual_seed(0)
    ref = openclip_forced_tiny().eval()
    ours = build_model(cfg, device="cpu").eval()
    ours.load_state_dict(ref.state_dict(), strict=True)  # same names and shapes
    assert any(isinstance(m, QuickGELU) for m in ours.modules())
    image, text = torch.randn(2, 3, 48, 48), torch.randint(1, 40000, (2, 20))
    text[:, 9], text[:, 10:] = 49407, 0
    with torch.no_grad():
        torch.testing.assert_close(ours.encode_image(image), ref.encode_image(image), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.encode_text(text), ref.encode_text(text), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "argv, size, context, pools_at",
    [(["--model", "tiny", *FORCES], 48, 20, 49407), (["--model", "ViT-L-14-worldwide"], 224, 77, 1)],
)
def test_a_synthetic_batch_has_the_forced_shapes_and_ends_where_the_text_tower_pools(
    argv, size, context, pools_at
):
    """What benchmarks and the planner's dry run feed a model: MetaCLIP 2's ViT-L-14 pools at mT5's eos_id 1."""
    images, texts = synthetic_batch(parse_train_args([*argv, "--batch-size", "3"]))
    assert images.shape == (3, 3, size, size) and texts.shape == (3, context)
    assert (texts[:, -1] == pools_at).all()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--force-image-size", "48", "64"], "square"),
        (["--model", "ViT-B-32", "--force-image-size", "16"], "patch size 32"),
        (["--force-context-length", "-1"], "--force-context-length"),
    ],
)
def test_impossible_forced_sizes_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_train_args(argv)
