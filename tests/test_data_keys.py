"""--image-key / --text-key (OpenCLIP main): shards whose image and caption members have other
suffixes than jpg/png/jpeg/webp and txt train and evaluate, read from real tar shards."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from test_data_common import IMAGE_SIZE, TOKENIZER, data_config, noise_image_bytes, write_shard

from bigclip.cli_args import parse_train_args
from bigclip.data.decode import SampleKeys
from bigclip.data.eval import iter_eval_samples
from bigclip.data.loader import build_train_loader
from bigclip.errors import ConfigError, DataError


def write_keyed_shards(root: Path) -> str:
    """Two shards of 6 samples: the image as KEY.image.png, the caption as KEY.caption.txt, and a
    decoy KEY.txt. Sample i5 of each shard has no caption.txt (only the decoy)."""
    rng = random.Random(0)
    sizes = {}
    for shard in range(2):
        samples = []
        for i in range(6):
            key = f"s{shard}i{i}"
            sample = {"__key__": key, "image.png": noise_image_bytes(rng), "txt": f"decoy of {key}"}
            if i != 5:
                sample["caption.txt"] = f"caption of {key}"
            samples.append(sample)
        write_shard(str(root / f"{shard:05d}.tar"), samples)
        sizes[f"{shard:05d}.tar"] = 6
    (root / "sizes.json").write_text(json.dumps(sizes))
    return str(root / "{00000..00001}.tar")


def loader(pattern: str, **keys: str):
    cfg = data_config(pattern, batch_size=2, **keys)
    return build_train_loader(cfg, rank=0, world_size=1, seed=0, epoch=0, image_size=IMAGE_SIZE,
                              tokenizer=TOKENIZER)  # fmt: skip


def captions_by_key(batches) -> dict[str, torch.Tensor]:
    return {k: t for b in batches for k, t in zip(b.keys, b.texts)}


def test_the_flags_set_the_members_read(tmp_path):
    cfg = parse_train_args(["--image-key", "image.png", "--text-key", "caption.txt;txt"])
    assert (cfg.data.image_key, cfg.data.text_key) == ("image.png", "caption.txt;txt")
    default = parse_train_args([])
    assert (default.data.image_key, default.data.text_key) == ("jpg;png;jpeg;webp", "txt")  # OpenCLIP's
    with pytest.raises(ConfigError, match="--text-key"):
        parse_train_args(["--text-key", ";"])


def test_training_reads_the_named_members_with_alternatives_in_order(tmp_path):
    pattern = write_keyed_shards(tmp_path)
    texts = captions_by_key(loader(pattern, image_key="image.png", text_key="caption.txt;txt"))
    assert len(texts) == 12  # every sample: i5 falls back to its txt
    for key, tokens in texts.items():
        caption = f"decoy of {key}" if key.endswith("i5") else f"caption of {key}"
        assert torch.equal(tokens, TOKENIZER([caption])[0]), key
    only = loader(pattern, image_key="image.png", text_key="caption.txt")
    assert sorted(captions_by_key(only)) == sorted(k for k in texts if not k.endswith("i5"))
    assert only.stats.skipped["no_text"] == 2  # no caption.txt: skipped and counted


def test_default_keys_find_no_image_in_such_shards(tmp_path):
    pattern = write_keyed_shards(tmp_path)
    with pytest.raises(DataError):
        list(loader(pattern))


def test_evaluation_reads_the_same_members(tmp_path):
    pattern = write_keyed_shards(tmp_path)

    keys = SampleKeys.parse(image_key="image.png", text_key="caption.txt;txt")
    samples = list(iter_eval_samples(pattern, image_size=IMAGE_SIZE, tokenizer=TOKENIZER, keys=keys))
    assert [s.caption for s in samples[:2]] == ["caption of s0i0", "caption of s0i1"]
    assert samples[5].caption == "decoy of s0i5" and len(samples) == 12
