"""The training pipeline on one rank: local shards, corrupt data, bad patterns, eval order, S3."""

import multiprocessing
import os
import random
from collections import Counter

import pytest
import torch
from test_data_common import (
    IMAGE_SIZE,
    TOKENIZER,
    data_config,
    good_sample,
    image_bytes,
    write_dataset,
    write_shard,
)

from bigclip.data.eval import iter_eval_samples, load_eval_set
from bigclip.data.loader import build_train_loader
from bigclip.data.shards import expand_pattern, validate_shards
from bigclip.data.tar_samples import key_and_ext
from bigclip.data.validation import validate_data
from bigclip.errors import DataError


def loader_for(cfg, **kw):
    options = {
        "rank": 0,
        "world_size": 1,
        "seed": 0,
        "epoch": 0,
        "image_size": IMAGE_SIZE,
        "tokenizer": TOKENIZER,
    }
    return build_train_loader(cfg, **(options | kw))


def consume(loader, steps=None):
    keys = []
    for i, batch in enumerate(loader):
        assert batch.images.shape == (loader.cfg.batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
        assert batch.texts.shape == (loader.cfg.batch_size, TOKENIZER.context_length)
        keys += batch.keys
        if steps is not None and i + 1 == steps:
            break
    return keys


def test_sample_keys_split_as_webdataset_splits_them():
    """bigclip reads tars itself (for cursors) but must group members into samples exactly as
    webdataset does; its rule is compared with webdataset's own function (a dev dependency)."""
    from webdataset.tariterators import base_plus_ext as reference  # never skipped: it is installed

    names = ["0001.jpg", "0001.txt", "a/b/0001.seg.png", "dir.v2/x.json", "noext", ".hidden", "a/.b.c",
             "x..y", "k.", "./k.jpg", "d/", "sample_00042.JPEG", "üñï.cöde.txt", "a b/c d.e f"]  # fmt: skip
    for name in names:
        assert key_and_ext(name) == reference(name), name


def test_expand_pattern_keeps_openclip_syntax():
    assert expand_pattern("/d/{000..002}.tar::/e/x.tar") == [
        "/d/000.tar",
        "/d/001.tar",
        "/d/002.tar",
        "/e/x.tar",
    ]


@pytest.mark.parametrize("workers", [0, 2])
def test_one_epoch_yields_every_sample_once(tmp_path, workers):
    pattern = write_dataset(str(tmp_path), [9, 7, 12, 4])  # 32 samples, batches of 4
    loader = loader_for(data_config(pattern, workers=workers))
    assert loader.steps_per_epoch == 8 and loader.num_samples == 32
    keys = consume(loader)
    assert len(keys) == 32 and len(set(keys)) == 32
    assert loader.stats.samples == 32 and loader.stats.skipped_total == 0


def test_batch_texts_are_the_tokenized_captions(tmp_path):
    pattern = write_dataset(str(tmp_path), [5])
    batch = next(iter(loader_for(data_config(pattern))))
    torch.testing.assert_close(batch.texts, TOKENIZER([f"caption of {k}" for k in batch.keys]))


def test_train_num_samples_sets_the_epoch_length(tmp_path):
    pattern = write_dataset(str(tmp_path), [10, 10, 10])
    loader = loader_for(data_config(pattern, train_num_samples=13))
    assert loader.steps_per_epoch == 3
    assert len(consume(loader)) == 12


def test_same_seed_same_stream_and_epochs_differ(tmp_path):
    pattern = write_dataset(str(tmp_path), [6, 6, 6, 6])
    cfg = data_config(pattern, workers=2)
    first, again = consume(loader_for(cfg)), consume(loader_for(cfg))
    assert first == again
    assert consume(loader_for(cfg, epoch=1)) != first


def write_corrupt_dataset(root) -> tuple[str, set[str]]:
    rng = random.Random(0)
    good = [good_sample(f"ok{i:02d}", rng) for i in range(10)]
    bad = [
        {"__key__": "bad_image", "jpg": b"\xff\xd8 not a jpeg", "txt": "x"},
        {"__key__": "no_text", "png": image_bytes((1, 2, 3))},
        {"__key__": "no_image", "xyz": b"?", "txt": "unknown extension"},
        {"__key__": "bad_text", "png": image_bytes((1, 2, 3)), "txt": b"\xff\xfe\xfa"},
    ]
    os.makedirs(root, exist_ok=True)
    write_shard(f"{root}/00000.tar", good[:3] + bad[:2] + good[3:5] + bad[2:])
    write_shard(f"{root}/00001.tar", good[5:10])
    with open(f"{root}/00001.tar", "r+b") as f:  # 2048 bytes a sample: cut in the 3rd one's txt header
        f.truncate(2 * 2048 + 1024 + 100)
    return f"{root}/{{00000..00001}}.tar", {s["__key__"] for s in good[:7]}


def test_corrupt_samples_and_truncated_shards_are_skipped_and_counted(tmp_path):
    pattern, readable = write_corrupt_dataset(str(tmp_path))
    loader = loader_for(data_config(pattern, batch_size=1, train_num_samples=100))
    assert set(consume(loader)) == readable
    assert loader.stats.skipped == Counter(bad_image=1, no_text=1, no_image=1, bad_text=1)
    assert loader.stats.broken_shards == [f"{tmp_path}/00001.tar"]
    assert loader.state_dict()["cursors"] == {}  # every shard done, damage included


def test_eval_samples_deterministic_split_by_rank(tmp_path):
    pattern, readable = write_corrupt_dataset(str(tmp_path))
    skipped = Counter()
    everything = list(iter_eval_samples(pattern, image_size=IMAGE_SIZE, tokenizer=TOKENIZER, skipped=skipped))
    assert [s.index for s in everything] == list(range(7)) and {s.key for s in everything} == readable
    assert sum(skipped.values()) == 4
    shares = [
        load_eval_set(pattern, image_size=8, tokenizer=TOKENIZER, rank=r, world_size=3) for r in range(3)
    ]
    assert sorted(i for s in shares for i in s.indices) == list(range(7))
    assert shares[1].indices == [1, 4] and shares[1].keys == [everything[i].key for i in (1, 4)]
    torch.testing.assert_close(shares[1].images[1], everything[4].image)
    torch.testing.assert_close(shares[1].texts[0], TOKENIZER([everything[1].caption])[0])
    assert len(load_eval_set(pattern, image_size=8, tokenizer=TOKENIZER, limit=5).keys) == 5


def test_pattern_matching_no_shard_fails_before_anything_is_built(tmp_path):
    with pytest.raises(DataError, match=r"matches no shard.*00099\.tar|matches no shard"):
        validate_shards(f"{tmp_path}/{{00000..00099}}.tar")
    with pytest.raises(DataError, match="matches no shard"):
        loader_for(data_config(f"{tmp_path}/missing-*.tar"))
    with pytest.raises(DataError, match="--train-data is empty"):
        loader_for(data_config(""))


def test_partly_missing_pattern_uses_the_shards_that_exist(tmp_path, caplog):
    write_dataset(str(tmp_path), [3, 3])
    shards = validate_shards(f"{tmp_path}/{{00000..00003}}.tar")
    assert len(shards) == 2 and len(shards.missing) == 2
    assert "2 of 4 shards are missing" in caplog.text


def test_unknown_epoch_size_or_too_little_data_are_clear_errors(tmp_path):
    pattern = write_dataset(str(tmp_path), [3, 3])
    os.remove(tmp_path / "sizes.json")
    with pytest.raises(DataError, match="--train-num-samples"):
        loader_for(data_config(pattern))
    with pytest.raises(DataError, match="less than one global batch"):
        loader_for(data_config(pattern, train_num_samples=6, batch_size=8))


def test_all_samples_corrupt_is_a_clear_error_not_an_empty_epoch(tmp_path):
    write_shard(f"{tmp_path}/0.tar", [{"__key__": f"k{i}", "jpg": b"junk", "txt": "x"} for i in range(8)])
    loader = loader_for(data_config(f"{tmp_path}/0.tar", train_num_samples=8))
    with pytest.raises(DataError, match="bad_image: 8"):
        consume(loader)


def test_validate_data_checks_val_shards_and_epoch_size_up_front(tmp_path):
    pattern = write_dataset(str(tmp_path), [3, 3])
    assert len(validate_data(data_config(pattern), world_size=1)) == 2
    with pytest.raises(DataError, match="--val-data"):
        validate_data(data_config(pattern, val_data=f"{tmp_path}/val-{{0..3}}.tar"), world_size=1)
    with pytest.raises(DataError, match="less than one global batch"):
        validate_data(data_config(pattern), world_size=2 * 6)


def test_close_stops_the_workers_after_leaving_the_loop_early(tmp_path):
    pattern = write_dataset(str(tmp_path), [20, 20])
    loader = loader_for(data_config(pattern, workers=2))
    assert len(consume(loader, steps=1)) == 4
    assert len(multiprocessing.active_children()) == 2
    loader.close()
    assert multiprocessing.active_children() == []


def test_malformed_position_is_a_clear_error(tmp_path):
    pattern = write_dataset(str(tmp_path), [4])
    with pytest.raises(DataError, match="malformed data position"):
        loader_for(data_config(pattern), position={"format": "bigclip.data.position/1", "epoch": 0})
