"""The Hugging Face tokenizer a model config names (`text_cfg.hf_tokenizer_name`: CLIPA's BERT,
MetaCLIP 2's XLM-V): bigclip's ids are OpenCLIP's `HFTokenizer`'s for the same files, and a run of
such a model trains from the offline Hugging Face cache on both engines, its text tower pooled where
that tokenizer writes the end of the sequence."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.hf_cache import populate_cache
from support.hf_tokenizers import bert_folder, eos_folder
from support.openclip_ref import open_clip_tokenizer_module

from bigclip.data.hf_tokenizer import HFTokenizer
from bigclip.errors import ConfigError
from bigclip.models.clip import CLIP, CLIPConfig, TextConfig, VisionConfig, init_weights

ROOT = Path(__file__).resolve().parents[1]
STRINGS = [
    "a photo of a cat",
    "A  Small RED circle, on a blue background &amp; at the top-left!",
    "caf\u00e9 na\u00efve_word with_underscores",
    " ".join(["large green square"] * 12),  # longer than the context: truncated, its end token kept
    "",
]


FOLDERS = {"bert": bert_folder, "eos": eos_folder}


@pytest.mark.parametrize(
    ("layout", "kwargs"),
    [
        ("bert", {"strip_sep_token": True}),
        ("bert", {"clean": "canonicalize"}),
        ("eos", {}),
        ("eos", {"clean": "lower"}),
    ],
)
def test_ids_are_openclips_hf_tokenizers(tmp_path, layout, kwargs):
    folder = FOLDERS[layout](tmp_path / layout)
    ours = HFTokenizer(str(folder), context_length=12, vocab_size=1000, **kwargs)
    ref = open_clip_tokenizer_module().HFTokenizer(str(folder), context_length=12, **kwargs)
    assert torch.equal(ours(STRINGS), ref(STRINGS))
    assert len(set(ours(STRINGS).flatten().tolist())) > 10  # words, not unknowns: a real vocabulary read
    assert torch.equal(pickle.loads(pickle.dumps(ours))(STRINGS), ref(STRINGS))  # as loader workers get it
    if layout == "eos":  # where the model's 'eos' pooling reads: the first id 2 of each row
        assert ((ours(STRINGS) == 2).sum(dim=1) == 1).all()


def test_a_tokenizer_with_more_ids_than_the_text_tower_is_refused(tmp_path):
    folder = bert_folder(tmp_path / "bert")
    with pytest.raises(ConfigError, match=r"has \d+ ids but model tiny-clipa's text_cfg.vocab_size is 8"):
        HFTokenizer(str(folder), context_length=12, vocab_size=8, model="tiny-clipa")


def test_an_eos_pooled_tower_refuses_a_tokenizer_that_never_writes_its_eos_id(tmp_path):
    """text_cfg.eos_id 3 where the tokenizer ends texts with 2: every text's features would be read at
    its first token (the pooling's argmax of no match), a silent loss of the whole text tower."""
    folder = eos_folder(tmp_path / "eos")
    assert HFTokenizer(str(folder), context_length=12, vocab_size=1000, pools_at=2)  # the id it writes
    with pytest.raises(
        ConfigError, match=r"does not write id 3, where model m's text tower pools .* ends texts with id 2"
    ):
        HFTokenizer(str(folder), context_length=12, vocab_size=1000, model="m", pools_at=3)
    bert = bert_folder(tmp_path / "bert")  # no eos_token: it ends texts with [SEP]
    with pytest.raises(ConfigError, match=r"does not write id 4, .*; it has no end-of-text token\)"):
        HFTokenizer(str(bert), context_length=12, vocab_size=1000, model="m", pools_at=4)


ZERO3 = ["--engine", "deepspeed", "--deepspeed-config", str(ROOT / "ds_configs" / "zero3.json")]


@pytest.mark.parametrize("engine", [[], ZERO3], ids=["fsdp", "deepspeed-zero3"])
@pytest.mark.slow
def test_a_model_reading_a_hugging_face_tokenizer_trains_from_the_offline_cache(demo_data, tmp_path, engine):
    """A tiny model with CLIPA's image options and MetaCLIP 2's text pooling, its config and its
    tokenizer both Hugging Face repositories in the --cache-dir cache, read with HF_HUB_OFFLINE=1."""
    tiny = json.loads((ROOT / "bigclip" / "models" / "configs" / "tiny.json").read_text())
    tiny["vision_cfg"] |= {
        "no_ln_pre": True,
        "pool_type": "avg",
        "final_ln_after_pool": True,
        "ls_init_value": 0.1,
    }
    tiny["text_cfg"] |= {"hf_tokenizer_name": "test-org/tiny-eos", "pool_type": "eos", "eos_id": 2,
                         "no_causal_mask": True, "vocab_size": 64}  # fmt: skip
    model = tmp_path / "model"
    model.mkdir()
    (model / "open_clip_config.json").write_text(json.dumps({"model_cfg": tiny, "preprocess_cfg": {}}))
    v, t = VisionConfig(**tiny["vision_cfg"]), TextConfig(**tiny["text_cfg"])
    weights = init_weights(CLIP(CLIPConfig(embed_dim=tiny["embed_dim"], vision_cfg=v, text_cfg=t)), seed=1)
    save_file(weights.state_dict(), model / "open_clip_model.safetensors")
    cache = tmp_path / "hf" / "hub"  # the default cache under HF_HOME=tmp_path/hf
    populate_cache(cache, "test-org/tiny-clip-eos", model)
    populate_cache(cache, "test-org/tiny-eos", eos_folder(tmp_path / "tokenizer"))
    command = [
        sys.executable, "-m", "bigclip.train", "--model", "hf-hub:test-org/tiny-clip-eos", "--cache-dir", str(cache),
        *engine, "--train-data", demo_data.train_pattern, "--train-num-samples", "8", "--batch-size", "4",
        "--workers", "1", "--epochs", "1", "--precision", "fp32", "--zeroshot-frequency", "0",
        "--val-data", demo_data.val_pattern, "--logs", str(tmp_path / "logs"), "--name", "eos",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    log = (tmp_path / "logs" / "eos" / "out.log").read_text()
    held = len(weights.state_dict())  # layer scale's gains in, ln_pre out
    assert f"loaded {held} tensors from --pretrained hf-hub:test-org/tiny-clip-eos" in log
    assert "clip_val_loss" in log and "done: {'step': 2" in log  # trained and evaluated its text tower
    if engine:
        return
    # OpenCLIP's layout carries the model's own tokenizer files, read from the same cache.
    consolidate = [sys.executable, "-m", "bigclip", "consolidate", str(tmp_path / "logs" / "eos" / "checkpoints"),
                   "--open-clip-dir", str(tmp_path / "open_clip"), "--no-progress"]  # fmt: skip
    out = subprocess.run(
        consolidate, env={**env, "HF_HOME": str(tmp_path / "hf")}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-4000:]
    config = json.loads((tmp_path / "open_clip" / "open_clip_config.json").read_text())
    assert config["model_cfg"]["text_cfg"]["hf_tokenizer_name"] == "test-org/tiny-eos"
    written = HFTokenizer(str(tmp_path / "open_clip"), context_length=32, vocab_size=64)
    trained = HFTokenizer(
        str(tmp_path / "tokenizer"), context_length=32, vocab_size=64
    )  # what the cache holds
    assert (
        torch.equal(written(STRINGS), trained(STRINGS))
        and not (tmp_path / "open_clip" / "merges.txt").exists()
    )
