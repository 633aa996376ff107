"""Every epoch accounts for its samples: balanced shares from sizes.json, every sample once per
epoch at any world size and worker count, resume included; and where sizes are missing or
wrong, or shards damaged, the shortfall is counted and named, never silent.

The data is img2dataset's four shards of 98/97/99/6 samples (the issue's case: an epoch read
210 of 300 samples on 2 ranks) plus an empty shard, over real gloo ranks.
"""

import json
import logging
import os
import random

import pytest
from test_data_common import IMAGE_SIZE, TOKENIZER, data_config, valid_keys, write_dataset

from bigclip.data.accounting import EpochAccount
from bigclip.data.loader import build_train_loader
from bigclip.data.resume.assignment import ShardTask, balanced
from bigclip.data.resume.position import DataPosition, RankProgress
from bigclip.data.tar_samples import START, Cursor
from bigclip.data.validation import validate_data
from bigclip.distributed import spawn
from bigclip.errors import DataError

SIZES = [98, 97, 0, 99, 6]  # 300 samples; no run of whole shards makes half of them: a split is needed
TOTAL = sum(SIZES)


def run_epoch(rank, world_size, pattern, opts):
    """One loader: its keys, steps, plan, final position and (when run to the end) the epoch's account."""
    cfg = data_config(
        pattern, workers=opts["workers"], batch_size=opts["batch"], train_num_samples=opts.get("num", 0)
    )
    loader = build_train_loader(
        cfg, rank=rank, world_size=world_size, seed=3, epoch=0, image_size=IMAGE_SIZE, tokenizer=TOKENIZER,
        position=opts.get("position"),
    )  # fmt: skip
    keys, stop_at = [], opts.get("steps", 0)
    for batch in loader:
        keys += batch.keys
        if stop_at and loader.steps == stop_at:
            break
    account = None if stop_at else loader.account_epoch()
    state = loader.state_dict()
    loader.close()
    return {"keys": keys, "steps": loader.steps, "planned": loader.steps_remaining + loader.steps,
            "state": state, "account": account}  # fmt: skip


def on_ranks(world_size, pattern, **opts):
    results = (
        spawn(run_epoch, world_size, pattern, opts, timeout_s=300)
        if world_size > 1
        else [run_epoch(0, 1, pattern, opts)]
    )
    assert len({r["steps"] for r in results}) == 1 and all(r["state"] == results[0]["state"] for r in results)
    return [k for r in results for k in r["keys"]], results[0]


@pytest.fixture(scope="module")
def shards(module_tmp):
    return write_dataset(str(module_tmp("img2dataset_like")), SIZES)


@pytest.mark.dist
@pytest.mark.parametrize(
    "world_size, workers, batch", [(2, 3, 10), (3, 2, 10), pytest.param(4, 2, 5, marks=pytest.mark.slow)]
)
def test_every_sample_once_per_epoch_in_the_planned_steps(shards, world_size, workers, batch):
    keys, rank0 = on_ranks(world_size, shards, workers=workers, batch=batch)
    assert len(keys) == len(set(keys)) == TOTAL and set(keys) == valid_keys(SIZES)
    assert rank0["steps"] == rank0["planned"] == TOTAL // (world_size * batch)
    account = rank0["account"]
    assert not account.short and account.samples == TOTAL and account.listed == TOTAL
    assert f"read {TOTAL} of the {TOTAL} samples sizes.json lists (0 not read)" in account.line()


@pytest.mark.dist
def test_a_remainder_smaller_than_one_global_batch_is_all_an_epoch_leaves(shards):
    keys, rank0 = on_ranks(2, shards, workers=2, batch=16)  # 300 = 9 x 32 + 12
    assert rank0["steps"] == rank0["planned"] == 9 and len(keys) == len(set(keys)) == 288
    assert "(12 not read) in 9 of 9 planned steps" in rank0["account"].line()


@pytest.mark.dist
def test_resume_mid_epoch_reads_the_rest_exactly_once(shards):
    first, phase1 = on_ranks(2, shards, workers=2, batch=10, steps=4)
    same, same_end = on_ranks(2, shards, workers=2, batch=10, position=phase1["state"])
    assert same_end["steps"] == 15 - 4 and sorted(first + same) == sorted(valid_keys(SIZES))
    other, other_end = on_ranks(3, shards, workers=1, batch=10, position=phase1["state"])
    assert other_end["steps"] == (TOTAL - 80) // 30  # 7 steps of 30, 10 samples left
    left, _ = on_ranks(1, shards, workers=0, batch=1, position=other_end["state"])
    seen = first + other + left
    assert len(seen) == len(set(seen)) and set(seen) == valid_keys(SIZES) and len(left) == 10


@pytest.mark.dist
def test_without_sizes_the_shortfall_is_counted_and_named(tmp_path):
    pattern = write_dataset(str(tmp_path), SIZES)
    os.remove(tmp_path / "sizes.json")  # whole shards by estimate: the 210-of-300 epoch
    keys, rank0 = on_ranks(2, pattern, workers=2, batch=10, num=TOTAL)
    account = rank0["account"]
    assert len(keys) == len(set(keys)) == account.samples < TOTAL and account.short and account.dry_ranks
    line = account.line()
    assert f"in {account.steps} of 15 planned steps, SHORT by {15 - account.steps} steps" in line
    assert "ran out of data" in line and "bigclip index-shards" in line


def test_a_resampled_epoch_is_not_said_to_lack_sizes():
    """--dataset-resampled draws with replacement: there is no listed total to read, whatever sizes.json says."""
    account = EpochAccount(
        epoch=0, samples=64, steps=2, planned_steps=2, global_batch=32, listed=None, resampled=True
    )
    line = account.line()
    assert "read 64 samples (drawn with replacement: --dataset-resampled) in 2 of 2 planned steps" in line
    assert "sizes.json" not in line


def test_a_shard_named_twice_is_read_once_and_the_log_says_so(shards, caplog):
    """OpenCLIP reads A::A twice per epoch; here each shard is read once, and the log says so."""
    with caplog.at_level(logging.WARNING, logger="bigclip.data"):
        found = validate_data(data_config(f"{shards}::{shards}"), world_size=1)
    assert len(found.urls) == len(SIZES) and found.total_samples == TOTAL
    assert "--train-data names 5 shard(s) more than once; each is read once per epoch" in caplog.text


def test_sizes_json_settles_the_epoch_before_any_read(shards, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="bigclip.data"):
        validate_data(data_config(shards), world_size=2)
    assert (
        "1 of the 5 shards of --train-data are empty (sizes.json): " in caplog.text
        and "00002.tar" in caplog.text
    )
    with pytest.raises(DataError, match=f"--train-num-samples 301 is more than the {TOTAL} samples"):
        validate_data(data_config(shards, train_num_samples=TOTAL + 1), world_size=1)
    validate_data(data_config(shards, train_num_samples=TOTAL + 1, dataset_resampled=True), world_size=1)
    empty = write_dataset(str(tmp_path / "empty"), [0, 0])
    with pytest.raises(DataError, match="lists no sample in its 2 shard"):
        validate_data(data_config(empty), world_size=1)
    os.remove(tmp_path / "empty" / "sizes.json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bigclip.data"):
        validate_data(data_config(empty, train_num_samples=8), world_size=1)
    assert "sizes.json lists 0 of the 2 shards" in caplog.text and "index-shards" in caplog.text


def test_a_damaged_shard_is_read_up_to_the_damage_and_named(tmp_path):
    pattern = write_dataset(str(tmp_path), [20, 20, 20])
    damaged = pattern.split("::")[1]
    with open(damaged, "r+b") as f:
        f.truncate(os.path.getsize(damaged) // 2)
    keys, rank0 = on_ranks(1, pattern, workers=1, batch=4)
    account = rank0["account"]
    assert account.broken == [damaged] and len(keys) == len(set(keys))
    assert set(keys) < valid_keys([20, 20, 20]) and any(k.startswith("s0001") for k in keys)
    assert f"damaged shards (read up to the damage): 1 ({damaged})" in account.line()


def test_a_stale_sizes_json_is_named_with_both_counts(tmp_path, caplog):
    pattern = write_dataset(str(tmp_path), [12, 12])
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 12, "00001.tar": 20}))
    with caplog.at_level(logging.WARNING, logger="bigclip.data"):
        keys, rank0 = on_ranks(1, pattern, workers=0, batch=4)
    account, stale = rank0["account"], pattern.split("::")[1]
    assert account.mismatched == {stale: [12, 20]} and sorted(keys) == sorted(valid_keys([12, 12]))
    assert account.short and f"{stale}: 12 found, 20 listed" in account.line()
    assert f"shard {stale} holds 12 samples, sizes.json lists 20" in caplog.text


def test_balanced_shares_split_at_most_one_shard_per_rank_boundary():
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice([0, 1, 5, 98, 99, 10_000]) for _ in range(rng.randrange(1, 12))]
        world = rng.randrange(1, 9)
        tasks = [ShardTask(i, f"{i}.tar", START, size) for i, size in enumerate(sizes)]
        ranks = balanced(tasks, world_size=world)
        shares = [sum(t.samples for t in rank) for rank in ranks]
        assert max(shares) - min(shares) <= 1 and sum(shares) == sum(sizes)
        covered = sorted(
            (t.shard, i) for rank in ranks for t in rank for i in range(t.start.index, t.stop or t.size)
        )
        assert covered == [(s, i) for s, size in enumerate(sizes) for i in range(size)]
        pieces = sum(len(rank) for rank in ranks)
        assert pieces <= len(sizes) + world - 1


def test_a_split_shards_position_keeps_both_readers_places():
    """Shard 0 split at 60 between two readers: each consumed part of its piece; both go on from there."""
    progress = RankProgress()
    progress.consume((0, 0, 60), Cursor(40, 4096))  # first reader: samples 0..39 of [0, 60)
    other = RankProgress()
    other.consume((0, 60, -1), Cursor(75, 9000))  # second reader: samples 60..74 of [60, end)
    start = DataPosition(epoch=0, num_shards=2, fingerprint="f")
    merged = start.merge([progress, other])
    assert [s.to_json() for s in merged.left(0)] == [[40, 4096, 60], [75, 9000, -1]]
    restored = DataPosition.from_json(json.loads(json.dumps(merged.to_json())))
    assert restored.left(0) == merged.left(0) and restored.left(1) == merged.left(1)
    done = RankProgress(ends={(0, 0, 60): Cursor(60, 5000)})
    done.consume((0, 0, 60), Cursor(60, 5000))
    assert [s.to_json() for s in restored.merge([done]).left(0)] == [[75, 9000, -1]]
