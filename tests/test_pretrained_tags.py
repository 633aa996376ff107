"""OpenCLIP's `--pretrained` tags: the shipped table is OpenCLIP's own, tags are matched as OpenCLIP
matches them, a wrong tag names the right ones, and a tag's preprocessing is applied or checked."""

from __future__ import annotations

import json
import logging

import pytest
from support.openclip_ref import open_clip_config, open_clip_pretrained_module

from bigclip.cli_args import parse_train_args
from bigclip.errors import ConfigError
from bigclip.models.named_configs import other_towers
from bigclip.models.pretrained_tags import _table, bundled_tag_models, get_tag, tags_for
from bigclip.weights.named import apply_preprocess

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]


def test_tag_table_is_openclips_for_every_bundled_model():
    openclip = open_clip_pretrained_module()._PRETRAINED  # OpenCLIP 3.3.0's, read from its file
    expected = {
        name: json.loads(json.dumps(openclip[name])) for name in bundled_tag_models() if name in openclip
    }
    assert _table() == expected
    built = [
        m
        for m in openclip
        if not other_towers(open_clip_config(m)) and "custom_text" not in open_clip_config(m)
    ]
    assert set(expected) == set(built)  # every tagged OpenCLIP model of OpenCLIP's own towers
    assert {"ViT-L-14-336", "ViT-H-14-378-quickgelu", "ViT-H-14-CLIPA-336", "ViT-bigG-14-worldwide"} <= set(
        built
    )
    for model, tag in [("ViT-B-32", "laion2b_s34b_b79k"), ("ViT-bigG-14", "LAION2B-S39B-B160K")]:
        assert get_tag(model, tag) == json.loads(
            json.dumps(open_clip_pretrained_module().get_pretrained_cfg(model, tag))
        )
    assert get_tag("ViT-B-32", "laion2b_s34b_b79k")["hf_hub"] == "laion/CLIP-ViT-B-32-laion2B-s34B-b79K/"
    assert get_tag("ViT-B-32", "openai")["quick_gelu"] is True
    assert tags_for("ViT-B-32-quickgelu") == ["openai", "laion400m_e31", "laion400m_e32", "metaclip_400m",
                                              "metaclip_fullcc"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--model", "ViT-B-32", "--pretrained", "laion2b_s39b_b160k"],
            [
                "ViT-B-32: its tags: openai, laion400m_e31,",
                "laion2b_s34b_b79k",
                "'laion2b_s39b_b160k' is a tag of ViT-bigG-14 (pass that --model)",
            ],
        ),
        (
            ["--model", "ViT-B-32-quickgelu", "--pretrained", "laion2b_s34b_b79k"],
            ["its tags: openai, laion400m_e31", "'laion2b_s34b_b79k' is a tag of ViT-B-32 "],
        ),
        (
            ["--model", "tiny", "--pretrained", "openai"],
            [
                "bigclip knows no OpenCLIP tags for it",
                "'openai' is a tag of ViT-B-16, ViT-B-16-quickgelu, ViT-B-32, ViT-B-32-quickgelu, ViT-L-14",
            ],
        ),
        (["--model", "ViT-B-32", "--pretrained", "no_such_tag"], ["there is no such file or folder"]),
        (
            ["--model", "RN50", "--pretrained", "yfcc15m"],
            ["model 'RN50' needs a ResNet image tower", "bigclip models"],
        ),
        (
            ["--model", "ViT-Q-99", "--pretrained", "laion400m_e32"],
            [
                "unknown model 'ViT-Q-99'",
                "'laion400m_e32' is known for ViT-B-16, ViT-B-16-plus-240, ViT-B-32, ViT-B-32-quickgelu, ViT-L-14",
            ],
        ),
        (
            ["--model", "hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K", "--pretrained", "laion2b_s34b_b79k"],
            ["OpenCLIP tags name weights of bigclip's bundled models", "brings its own weights"],
        ),
        (
            ["--model", "ViT-Q-99", "--pretrained", "yfcc15m"],
            [
                "unknown model 'ViT-Q-99'; available: tiny, ViT-B-16, ViT-B-16-plus,",
                "hf-hub:ORG/REPO",
                "the OpenCLIP tag 'yfcc15m' is known for none of them",
            ],
        ),
    ],  # fmt: skip
)
def test_a_wrong_tag_is_refused_naming_the_tags_there_are(argv, said):
    with pytest.raises(ConfigError) as info:
        parse_train_args(argv)
    for text in said:
        assert text in str(info.value)


def test_tags_are_matched_as_openclip_matches_them_and_files_are_still_files(tmp_path, monkeypatch):
    cfg = parse_train_args(["--model", "ViT-B-32", "--pretrained", "LAION2B-S34B-B79K"])
    assert (
        get_tag(cfg.model.model, cfg.model.pretrained)["hf_hub"] == "laion/CLIP-ViT-B-32-laion2B-s34B-b79K/"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_weights").mkdir()  # a checkpoint folder in the working directory is not a tag
    assert (
        parse_train_args(["--model", "ViT-B-32", "--pretrained", "my_weights"]).model.pretrained
        == "my_weights"
    )


def preprocessed(*argv: str, caplog: pytest.LogCaptureFixture) -> tuple[dict, str]:
    cfg = parse_train_args(list(argv))
    with caplog.at_level(logging.WARNING, logger="test.pretrained"):
        apply_preprocess(cfg, logging.getLogger("test.pretrained"))
    return cfg.data.__dict__, caplog.text


def test_the_tags_mean_and_std_are_used_unless_given(caplog):
    data, warned = preprocessed("--model", "ViT-L-14", "--pretrained", "laion2b_s32b_b82k", caplog=caplog)
    assert (data["image_mean"], data["image_std"]) == ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])  # Inception's
    assert warned == ""
    data, _ = preprocessed("--model", "ViT-L-14", "--pretrained", "laion2b_s32b_b82k", "--image-mean", "0.4",
                           caplog=caplog)  # fmt: skip
    assert (data["image_mean"], data["image_std"]) == ([0.4], [0.5, 0.5, 0.5])
    data, _ = preprocessed("--model", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k", caplog=caplog)
    assert data["image_mean"] == OPENAI_MEAN
    data, _ = preprocessed("--model", "ViT-B-32", "--pretrained", "/some/file.pt", caplog=caplog)
    assert data["image_mean"] == []  # a file says nothing: OpenAI's default, as before


def test_quick_gelu_and_resize_mismatches_are_warned_as_openclip_warns(caplog):
    _, warned = preprocessed("--model", "ViT-B-32", "--pretrained", "openai", caplog=caplog)
    assert "QuickGELU mismatch: --model ViT-B-32 builds quick_gelu=False" in warned
    assert "use --model ViT-B-32-quickgelu or --force-quick-gelu" in warned
    caplog.clear()
    for argv in (["--model", "ViT-B-32-quickgelu"], ["--model", "ViT-B-32", "--force-quick-gelu"]):
        _, warned = preprocessed(*argv, "--pretrained", "openai", caplog=caplog)
        assert warned == ""
    _, warned = preprocessed("--model", "ViT-H-14-quickgelu", "--pretrained", "dfn5b", caplog=caplog)
    assert "--pretrained dfn5b was trained with resize_mode 'squash'; evaluation uses 'shortest'" in warned
    assert "--image-resize-mode squash" in warned and "QuickGELU" not in warned
