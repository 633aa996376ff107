"""`bigclip consolidate SRC --transformers-dir DIR` against the real Hugging Face transformers package.

A checkpoint written by FSDP2 at 2 ranks after a few steps (its attention projections sharded by
rows across the ranks) is exported in small pieces; `transformers.CLIPModel.from_pretrained(DIR)`
loads it with no missing, unexpected or mismatched weight and gives the image and text features of
bigclip's model on the same inputs, from bigclip's token ids and from its own CLIPTokenizer's, and
its CLIPImageProcessor the pixels of bigclip's evaluation transform. A -quickgelu model, bf16 and
sharded output (transformers' index) load too; layouts CLIPModel cannot hold are refused before
anything is written. transformers is in the dev extra: missing, these tests skip (fail under CI).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from support.engine_harness import global_batch
from support.openclip_ref import transformers_package
from test_engine_deepspeed import config
from test_open_clip_export import train_and_save

from bigclip.data.bpe_tokenizer import ClipBpeTokenizer
from bigclip.data.device import ImageNormalizer
from bigclip.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, eval_transform
from bigclip.demo.shapes_data import Attributes, draw
from bigclip.distributed import spawn
from bigclip.errors import ConfigError
from bigclip.models.factory import create_model
from bigclip.weights.consolidate_command import main as consolidate_main

STRINGS = [
    "a large red circle at the center",
    "a photo of a cat",
    "two small blue squares on a green background",
]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # attention kernels differ between torch and transformers releases


def features(hf_model, images: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIPModel's projected features (a tensor before transformers 5, the output's pooler_output after)."""
    with torch.no_grad():
        image, text = (
            hf_model.get_image_features(pixel_values=images),
            hf_model.get_text_features(input_ids=ids),
        )
    return getattr(image, "pooler_output", image), getattr(text, "pooler_output", text)


def load(transformers, folder) -> object:
    model, info = transformers.CLIPModel.from_pretrained(str(folder), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.dist
def test_a_sharded_checkpoint_loads_in_transformers_with_the_same_features(tmp_path):
    transformers = transformers_package()
    saved = spawn(train_and_save, 2, config("fsdp"), str(tmp_path / "ckpt"))[0]
    hashing_run, run = saved["checkpoints"]  # newest first
    folder = tmp_path / "hf"
    # 1 KiB pieces: every fused attention projection is cut into q, k and v across pieces and shards.
    assert (
        consolidate_main([run, "--transformers-dir", str(folder), "--piece-size", "1KiB", "--no-progress"])
        == 0
    )
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "preprocessor_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    config_json = json.loads((folder / "config.json").read_text())
    assert config_json["vision_config"]["hidden_act"] == "gelu" and config_json["bigclip"]["step"] == 3
    hf_model = load(transformers, folder)

    model = create_model("tiny", device="cpu").eval()
    model.load_state_dict(saved["weights"], strict=True)
    images, texts = global_batch(0, 4)
    image, text = features(hf_model, images, texts)
    with torch.no_grad():
        torch.testing.assert_close(image, model.encode_image(images), **TOLERANCE)
        torch.testing.assert_close(text, model.encode_text(texts), **TOLERANCE)
        torch.testing.assert_close(hf_model.logit_scale, model.logit_scale, rtol=0, atol=0)

    # Its own tokenizer: OpenCLIP's ids up to the end of text (it pads with that token, OpenCLIP with
    # 0), and so the same text features (pooled at the first end of text, behind a causal mask).
    ours = ClipBpeTokenizer(context_length=32)(STRINGS)
    tokenizer = transformers.CLIPTokenizer.from_pretrained(str(folder))
    theirs = tokenizer(STRINGS, padding="max_length", max_length=32, return_tensors="pt").input_ids
    for mine, hf_ids in zip(ours, theirs):
        end = int(mine.argmax()) + 1
        assert mine[:end].tolist() == hf_ids[:end].tolist()
    with torch.no_grad():
        torch.testing.assert_close(
            features(hf_model, images, theirs)[1], model.encode_text(ours), **TOLERANCE
        )

    picture = draw(
        Attributes("large", "red", "circle", "center", "black"), image_size=90, rng=random.Random(0)
    )
    pixels = transformers.CLIPImageProcessor.from_pretrained(str(folder))(
        picture, return_tensors="pt"
    ).pixel_values
    ours_pixels = torch.from_numpy(np.array(eval_transform(64)(picture)))[None]
    normalized = ImageNormalizer(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)(ours_pixels)
    torch.testing.assert_close(pixels, normalized, rtol=0, atol=1e-5)

    with pytest.raises(ConfigError, match="trained with --tokenizer hashing"):
        consolidate_main([hashing_run, "--transformers-dir", str(tmp_path / "refused"), "--no-progress"])
    assert not (tmp_path / "refused").exists()


def test_quickgelu_bf16_and_sharded_exports_load(tmp_path):
    """A -quickgelu model from a torch file (no saved config: --model names it), in bf16 and shards."""
    transformers = transformers_package()
    model = create_model("tiny-quickgelu", device="cpu", seed=7).eval()
    torch.save({"state_dict": model.state_dict()}, tmp_path / "w.pt")
    folder = tmp_path / "hf"
    argv = [
        str(tmp_path / "w.pt"),
        "--transformers-dir",
        str(folder),
        "--model",
        "tiny-quickgelu",
        "--no-progress",
    ]
    assert consolidate_main([*argv, "--dtype", "bf16", "--max-shard-size", "2MB"]) == 0
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # transformers' shard names and index
    config_json = json.loads((folder / "config.json").read_text())
    assert (
        config_json["text_config"]["hidden_act"] == "quick_gelu" and config_json["torch_dtype"] == "bfloat16"
    )
    hf_model = load(transformers, folder).float()
    images, texts = torch.randn(2, 3, 64, 64), ClipBpeTokenizer(context_length=32)(STRINGS[:2])
    reference = create_model("tiny-quickgelu", device="cpu").eval()
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    image, text = features(hf_model, images, texts)
    with torch.no_grad():
        torch.testing.assert_close(image, reference.encode_image(images), **TOLERANCE)
        torch.testing.assert_close(text, reference.encode_text(texts), **TOLERANCE)


def test_layouts_clip_model_cannot_hold_are_refused_before_anything_is_written(tmp_path):
    model = create_model("tiny", device="cpu")
    siglip = {**model.state_dict(), "logit_bias": torch.zeros(())}
    torch.save(siglip, tmp_path / "siglip.pt")
    with pytest.raises(ConfigError, match="learned logit bias .a SigLIP model"):
        consolidate_main(
            [str(tmp_path / "siglip.pt"), "--transformers-dir", str(tmp_path / "out"), "--model", "tiny"]
        )
    extra = {**model.state_dict(), "visual.attn_pool.query": torch.zeros(4, 64)}
    torch.save(extra, tmp_path / "extra.pt")
    with pytest.raises(
        ConfigError, match=r"visual.attn_pool.query \[4, 64\]: transformers' CLIPModel has no place"
    ):
        consolidate_main(
            [str(tmp_path / "extra.pt"), "--transformers-dir", str(tmp_path / "out"), "--model", "tiny"]
        )
    assert not (tmp_path / "out").exists()


def test_openclip_options_clip_model_lacks_are_named():
    """CLIPA's average pooling, bidirectional text and BERT tokenizer; MetaCLIP 2's eos pooling;
    layer scale: CLIPModel computes none of them, so their export is refused naming them."""
    from bigclip.models.families import family_of
    from bigclip.models.shape import ModelOptions
    from bigclip.weights.transformers_export import options_clip_model_lacks

    def lacks(name: str) -> list[str]:
        return options_clip_model_lacks(family_of(name).open_clip_config(name, ModelOptions()))

    assert lacks("ViT-B-32") == [] and lacks("ViT-L-14-336") == []
    assert lacks("ViT-L-14-CLIPA") == [
        "vision_cfg.pool_type 'avg'", "vision_cfg.no_ln_pre True", "vision_cfg.final_ln_after_pool True",
        "text_cfg.pool_type 'last'", "text_cfg.no_causal_mask True", "text_cfg.hf_tokenizer_name 'bert-base-uncased'",
    ]  # fmt: skip
    assert lacks("ViT-H-14-worldwide") == [
        "text_cfg.pool_type 'eos'",
        "text_cfg.hf_tokenizer_name 'facebook/xlm-v-base'",
    ]
    assert lacks("ViT-M-16-alt") == ["vision_cfg.ls_init_value 0.0001"]
