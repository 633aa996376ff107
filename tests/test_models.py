"""Model layout, sizes and numerics against OpenCLIP's own code."""

import json
import time
import tracemalloc

import pytest
import torch
from support.openclip_ref import (
    open_clip_clip,
    open_clip_config,
    open_clip_config_names,
    open_clip_model_module,
)

from bigclip.errors import ConfigError
from bigclip.models.clip import CLIP, init_weights
from bigclip.models.factory import count_parameters, create_model
from bigclip.models.named_configs import (
    OTHER_TOWERS_PATH,
    CLIPConfig,
    TextConfig,
    VisionConfig,
    _config_files,
    list_models,
    other_towers,
)
from bigclip.models.vision import PatchDropout

# OpenCLIP's parameter counts in millions: total, image tower, text tower.
OPENCLIP_SIZES = {
    "ViT-B-32": (151.28, 87.85, 63.43),
    "ViT-B-16": (149.62, 86.19, 63.43),
    "ViT-L-14": (427.62, 303.97, 123.65),
    "ViT-H-14": (986.11, 632.08, 354.03),
    "ViT-g-14": (1366.68, 1012.65, 354.03),
    "ViT-bigG-14": (2539.57, 1844.91, 694.66),
}


@pytest.mark.parametrize("name", sorted(OPENCLIP_SIZES))
def test_parameter_counts_match_openclip(name):
    counts = count_parameters(create_model(name, device="meta"))
    got = tuple(round(counts[k] / 1e6, 2) for k in ("total", "image", "text"))
    assert got == pytest.approx(OPENCLIP_SIZES[name], abs=0.01)


def test_all_openclip_configs_listed():
    assert set(OPENCLIP_SIZES) | {"tiny"} <= set(list_models())


def test_every_openclip_config_of_its_own_towers_is_bundled_and_the_others_name_their_tower():
    """OpenCLIP's towers are its VisionTransformer and TextTransformer at the model's root; the rest
    (timm, Hugging Face, ResNet, CoCa) are refused naming the tower (tests/test_bad_input_flags.py)."""
    own, other = [], []
    for name in open_clip_config_names():
        raw = open_clip_config(name)
        (other if other_towers(raw) or raw.get("custom_text") else own).append(name)
    for name in own:  # bundled, or the -quickgelu form of a bundled config, which is what that means
        base = name.removesuffix("-quickgelu")
        assert base in list_models(), name
        assert open_clip_config(name) == open_clip_config(base) | (
            {"quick_gelu": True} if name != base else {}
        )
    assert len(own) >= 45 and not [n for n in other if n in list_models()]
    shipped = json.loads(OTHER_TOWERS_PATH.read_text())  # refused by name: `--model EVA02-L-14`
    assert shipped == {
        n: other_towers(open_clip_config(n)) or ["OpenCLIP's custom text tower layout"] for n in other
    }


def shrunk(name: str) -> dict:
    """OpenCLIP's config `name` with tiny towers: every option kept, widths, depths and sizes cut."""
    cfg = open_clip_config(name)
    tokenizer = ("hf_tokenizer_name", "tokenizer_kwargs")
    v, t = dict(cfg["vision_cfg"]), {k: x for k, x in cfg["text_cfg"].items() if k not in tokenizer}
    v.update(layers=2, width=64, head_width=16, image_size=v["patch_size"] * 3)
    t.update(layers=2, width=48, heads=4, vocab_size=1000, context_length=16)
    return {"embed_dim": 32, "vision_cfg": v, "text_cfg": t, "quick_gelu": cfg.get("quick_gelu", False)}


@pytest.mark.parametrize("name", [n for n in list_models() if n != "tiny"])
def test_every_bundled_configs_options_give_openclips_features(name):
    """Pooling (class token or average; text at the highest id, the first eos_id or the last
    position), layer scale, no ln_pre, ln_post after pooling, a bidirectional text tower: each
    config's options on tiny towers, with OpenCLIP's weights (moved off their init), give OpenCLIP's
    features."""
    cfg = shrunk(name)
    torch.manual_seed(0)
    ref = open_clip_model_module().CLIP(**json.loads(json.dumps(cfg))).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # LayerScale gains and norms away from their init
    v, t = VisionConfig(**cfg["vision_cfg"]), TextConfig(**cfg["text_cfg"])
    ours = CLIP(CLIPConfig(embed_dim=32, vision_cfg=v, text_cfg=t, quick_gelu=cfg["quick_gelu"])).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    image = torch.randn(2, 3, v.image_size, v.image_size)
    text = torch.randint(3, 900, (2, 16))
    text[:, 9], text[:, 10:], text[0, 4] = t.eos_id, 0, 999  # an eos id, padding, a highest id before it
    with torch.no_grad():
        torch.testing.assert_close(ours.encode_image(image), ref.encode_image(image), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.encode_text(text), ref.encode_text(text), rtol=1e-5, atol=1e-5)


def test_bundled_configs_are_openclips_own():
    """Every bundled config but bigclip's tiny is OpenCLIP's file of that name, value for value."""
    for name in list_models():
        if name != "tiny":
            assert json.loads(_config_files()[name]) == open_clip_config(name), name


@pytest.mark.parametrize("name", list_models())
def test_state_dict_layout_matches_openclip(name):
    """Every bundled config, its image size other than 224 included, builds OpenCLIP's keys and shapes."""
    ours = create_model(name, device="meta").state_dict()
    with torch.device("meta"):
        ref = open_clip_clip(name).state_dict()
    assert list(ours) == list(ref)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in ref.items()}


@pytest.mark.parametrize("name", ["tiny", "ViT-B-32"])
@pytest.mark.slow
def test_openclip_weights_give_same_features(name):
    torch.manual_seed(0)
    ref = open_clip_clip(name).eval()
    ours = create_model(name, device="cpu").eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    image = torch.randn(2, 3, ours.image_size, ours.image_size)
    text = torch.randint(1, 40000, (2, ours.context_length))
    text[:, 7], text[:, 8:] = 49407, 0  # end-of-text then padding, as OpenCLIP's tokenizer writes
    with torch.no_grad():
        torch.testing.assert_close(ours.encode_image(image), ref.encode_image(image), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.encode_text(text), ref.encode_text(text), rtol=1e-5, atol=1e-5)
        assert ours.logit_scale.exp().item() == pytest.approx(ref.logit_scale.exp().item())


def test_bigG_builds_on_meta_quickly_without_memory():
    tracemalloc.start()
    start = time.perf_counter()
    model = create_model("ViT-bigG-14", device="meta")
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(p.is_meta for p in model.parameters())
    assert elapsed < 10
    assert peak < 200 * 2**20  # 2.5 B parameters would be 10 GB in fp32


def test_init_is_deterministic_and_meta_init_matches_direct():
    a = create_model("tiny", device="cpu", seed=3)
    b = create_model("tiny", device="meta").to_empty(device="cpu")
    init_weights(b, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    c = create_model("tiny", device="cpu", seed=4)
    assert not torch.equal(a.visual.proj, c.visual.proj)


def test_unknown_model_lists_valid_names():
    with pytest.raises(ConfigError, match="ViT-bigG-14"):
        create_model("ViT-Huge-99")


def test_patch_dropout_keeps_class_token_and_fraction():
    torch.manual_seed(0)
    x = torch.randn(4, 1 + 64, 8)
    drop = PatchDropout(0.75).train()
    y = drop(x)
    assert y.shape == (4, 1 + 16, 8)
    assert torch.equal(y[:, 0], x[:, 0])
    # every kept token is one of that image's own patches, without repeats
    for i in range(4):
        kept = {tuple(t.tolist()) for t in y[i, 1:]}
        assert len(kept) == 16 and kept <= {tuple(t.tolist()) for t in x[i, 1:]}
    assert torch.equal(drop.eval()(x), x)


def test_patch_dropout_only_while_training():
    model = create_model("tiny", device="cpu", patch_dropout=0.5)
    image = torch.randn(2, 3, 64, 64)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.encode_image(image), model.encode_image(image))
        model.train()
        assert not torch.equal(model.encode_image(image), model.encode_image(image))


def test_grad_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    image, text = torch.randn(2, 3, 64, 64), torch.randint(0, 49408, (2, 32))
    grads = []
    for ckpt in (False, True):
        model = create_model("tiny", device="cpu")
        model.set_grad_checkpointing(ckpt)
        out = model(image, text)
        (out["logit_scale"] * out["image_features"] @ out["text_features"].T).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0, msg=name)


def test_bigclip_models_lists_each_config_with_its_image_size_and_tags(capsys):
    from bigclip.models import listing

    assert listing.main([]) == 0
    rows = {line.split()[0]: line.split(None, 5) for line in capsys.readouterr().out.splitlines()[1:]}
    assert list(rows) == list_models()
    assert rows["ViT-L-14-336"][1:3] == ["336", "427.94"]
    assert "openai (-quickgelu)" in rows["ViT-L-14-336"][5] and rows["ViT-e-14"][5] == "-"
