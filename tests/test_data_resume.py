"""Exact resume of the data stream across world sizes and worker counts, with real processes over gloo.

Phase 1 consumes a few steps at N ranks and merges the position from every rank's own state
(checked equal to the one the ranks gather); phase 2 resumes it at M ranks (other worker
counts) and runs to the end of the epoch; phase 3 drains, on one rank
with batch size 1, whatever the end-of-epoch rule left. Across the three phases every valid
sample must appear exactly once: nothing seen twice, nothing lost, and what phase 2's end
rule dropped is exactly what its final position still lists as unconsumed.
"""

import os
import shutil
from collections import Counter

import pytest
from test_data_common import IMAGE_SIZE, TOKENIZER, data_config, valid_keys, write_dataset

from bigclip.data.loader import build_train_loader
from bigclip.data.resume.assignment import draw_shard
from bigclip.data.resume.position import decode_bitmap
from bigclip.data.resume.rank_state import merge_rank_states
from bigclip.data.validation import validate_data
from bigclip.distributed import spawn
from bigclip.errors import ConfigError, DataError

SIZES = [13, 7, 22, 9, 16, 11, 5, 18, 10]  # unequal shards; one compressed, every 6th sample corrupt
BAD_EVERY = 6
BATCH = 4


def run_phase(
    rank, world_size, pattern, *, workers, batch_size, steps, position, resampled=False, num_samples=0
):
    cfg = data_config(
        pattern,
        workers=workers,
        batch_size=batch_size,
        dataset_resampled=resampled,
        train_num_samples=num_samples,
    )
    loader = build_train_loader(
        cfg,
        rank=rank,
        world_size=world_size,
        seed=5,
        epoch=0,
        image_size=IMAGE_SIZE,
        tokenizer=TOKENIZER,
        position=position,
    )
    keys = []
    for batch in loader:
        keys += batch.keys
        if steps and loader.steps == steps:
            break
    return {
        "keys": keys,
        "state": loader.state_dict(),
        "rank_state": loader.rank_state(),
        "steps": loader.steps,
        "skipped": loader.stats.skipped_total,
    }


def spawned_phase(rank, world_size, pattern, options):
    return run_phase(rank, world_size, pattern, **options)


def run_ranks(world_size, pattern, **options):
    """All ranks' keys, the position and the step count; a world of one runs in this process.

    The position is the one merged from every rank's own state (no collective), checked equal to the
    one the ranks gathered (less its stream state, which a resume at another world size ignores)."""
    if world_size == 1:
        results = [run_phase(0, 1, pattern, **options)]
    else:
        results = spawn(spawned_phase, world_size, pattern, options, timeout_s=240)
    assert all(r["state"] == results[0]["state"] for r in results), "ranks disagree on the gathered position"
    assert len({r["steps"] for r in results}) == 1, "ranks took different numbers of steps"
    merged = merge_rank_states([r["rank_state"] for r in reversed(results)])  # any order
    assert merged == {k: v for k, v in results[0]["state"].items() if k != "stream"}
    return [k for r in results for k in r["keys"]], merged, results[0]["steps"]


@pytest.fixture(scope="module")
def dataset(module_tmp):
    root = str(module_tmp("resume"))
    return write_dataset(root, SIZES, compressed=(3,), bad_every=BAD_EVERY)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "n, workers_n, m, workers_m",
    [(1, 2, 4, 0), (2, 0, 3, 2), (3, 1, 2, 1), (4, 2, 1, 0)],  # every world size on each side
)
def test_resume_at_another_world_size_sees_every_sample_once(dataset, n, workers_n, m, workers_m):
    first, position, steps = run_ranks(
        n, dataset, workers=workers_n, batch_size=BATCH, steps=3, position=None
    )
    assert steps == 3 and len(first) == 3 * BATCH * n and position["samples"] == len(first)
    second, final, _ = run_ranks(m, dataset, workers=workers_m, batch_size=BATCH, steps=0, position=position)
    assert final["samples"] == len(first) + len(second)
    drained = run_phase(0, 1, dataset, workers=0, batch_size=1, steps=0, position=final)
    seen = first + second + drained["keys"]
    assert len(seen) == len(set(seen)), "a sample was seen twice"
    assert set(seen) == valid_keys(SIZES, bad_every=BAD_EVERY), "a sample was skipped"
    # The documented end-of-epoch bound: the greedy plan leaves ranks within one shard of each
    # other, plus one short batch per rank.
    assert len(drained["keys"]) <= m * (max(SIZES) + BATCH)
    assert drained["state"]["cursors"] == {} and drained["state"]["samples"] == len(seen)


@pytest.mark.dist
def test_ranks_stop_together_and_explain_when_one_rank_has_no_data(tmp_path):
    pattern = write_dataset(str(tmp_path), [10])
    os.remove(tmp_path / "sizes.json")  # sizes unknown: the one shard goes whole to rank 0
    with pytest.raises(RuntimeError, match="not every rank could fill one batch"):
        spawn(
            spawned_phase,
            2,
            pattern,
            {"workers": 0, "batch_size": 2, "steps": 0, "position": None, "num_samples": 10},
            timeout_s=120,
        )


def test_resume_in_one_process_with_other_workers(dataset):
    first = run_phase(0, 1, dataset, workers=2, batch_size=BATCH, steps=5, position=None)
    rest = run_phase(0, 1, dataset, workers=1, batch_size=BATCH, steps=0, position=first["state"])
    seen = first["keys"] + rest["keys"]
    assert len(seen) == len(set(seen))
    left = run_phase(0, 1, dataset, workers=0, batch_size=1, steps=0, position=rest["state"])["keys"]
    assert len(left) < BATCH and set(seen + left) == valid_keys(SIZES, bad_every=BAD_EVERY)


def test_resampled_resume_continues_the_step_budget(dataset):
    first = run_phase(0, 1, dataset, workers=1, batch_size=BATCH, steps=4, position=None, resampled=True)
    assert first["state"]["mode"] == "resampled" and first["state"]["samples"] == 4 * BATCH
    rest = run_phase(
        0, 1, dataset, workers=0, batch_size=BATCH, steps=0, position=first["state"], resampled=True
    )
    assert 4 + rest["steps"] == sum(SIZES) // BATCH  # the epoch's planned steps, resume included
    assert rest["keys"] and set(rest["keys"]) <= valid_keys(SIZES, bad_every=BAD_EVERY)


def keys_of_position(position: dict, pattern: str) -> Counter:
    """What a resampled position says was consumed: done draws whole, partial draws up to their cursor."""
    shard_of = draw_shard(validate_data(data_config(pattern), world_size=1), seed=5, epoch=0)
    consumed = Counter()  # shard i of the pattern has SIZES[i] samples
    prefixes = {int(d): c[0] for d, c in position["cursors"].items()}
    prefixes |= {d: max(SIZES) for d in decode_bitmap(position["done"], position["draws"])}
    for draw, end in prefixes.items():
        shard = shard_of(draw)
        consumed.update(
            f"s{shard:04d}i{i:04d}" for i in range(min(end, SIZES[shard])) if i % BAD_EVERY != BAD_EVERY - 1
        )
    return consumed


@pytest.mark.dist
def test_resampled_resume_at_another_world_size_continues_the_draws(dataset):
    """2 -> 3 ranks: the keys consumed are exactly those the positions define, no draw read twice."""
    options = {"workers": 1, "batch_size": BATCH, "resampled": True}
    first, state, _ = run_ranks(2, dataset, steps=3, position=None, **options)
    assert Counter(first) == keys_of_position(state, dataset) and state["draws"] > 0
    second, after, _ = run_ranks(3, dataset, steps=4, position=state, **options)
    assert Counter(first) + Counter(second) == keys_of_position(after, dataset)
    assert after["draws"] > state["draws"] and after["samples"] == state["samples"] + 4 * 3 * BATCH
    done = decode_bitmap(after["done"], after["draws"])
    for draw, (index, _) in state["cursors"].items():  # every partial draw went on from its cursor
        assert int(draw) in done or after["cursors"][draw][0] >= index
    again, _, _ = run_ranks(3, dataset, steps=4, position=state, **options)
    assert again == second  # the stream after the resume is a function of the position


def test_position_from_other_data_or_epoch_is_refused(dataset, tmp_path):
    state = run_phase(0, 1, dataset, workers=0, batch_size=BATCH, steps=1, position=None)["state"]
    other = write_dataset(str(tmp_path), [5, 5])
    with pytest.raises(DataError, match="shards changed"):
        run_phase(0, 1, other, workers=0, batch_size=BATCH, steps=0, position=state)
    with pytest.raises(DataError, match="dataset-resampled"):
        run_phase(0, 1, dataset, workers=0, batch_size=BATCH, steps=0, position=state, resampled=True)
    with pytest.raises(DataError, match="not a bigclip data position"):
        run_phase(0, 1, dataset, workers=0, batch_size=BATCH, steps=0, position={"epoch": 0})


def test_resampled_stream_of_unreadable_shards_stops_with_a_clear_error(tmp_path):
    pattern = write_dataset(str(tmp_path), [4, 4], bad_every=1)  # every sample corrupt
    with pytest.raises(DataError, match="bad_image"):
        run_phase(0, 1, pattern, workers=0, batch_size=2, steps=0, position=None, resampled=True)


def validate_on_ranks(rank, world_size, good, bad):
    shards = validate_data(data_config(good), world_size=world_size)
    try:
        validate_data(data_config(bad), world_size=world_size)
    except DataError as e:
        return shards, str(e)
    return shards, ""


@pytest.mark.dist
def test_validation_runs_once_and_every_rank_gets_the_result_or_the_error(dataset, tmp_path):
    results = spawn(validate_on_ranks, 2, dataset, f"{tmp_path}/none-{{0..9}}.tar", timeout_s=120)
    assert results[0] == results[1]
    assert len(results[0][0]) == len(SIZES) and "matches no shard" in results[0][1]


def test_a_moved_dataset_keeps_its_position(dataset, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(os.path.dirname(dataset.split("::")[0]), moved)
    state = run_phase(0, 1, dataset, workers=0, batch_size=BATCH, steps=2, position=None)["state"]
    pattern = "::".join(str(moved / os.path.basename(p)) for p in dataset.split("::"))
    rest = run_phase(0, 1, pattern, workers=0, batch_size=BATCH, steps=0, position=state)
    assert rest["state"]["samples"] > state["samples"]


def test_upsampling_factors_weight_each_source_as_openclip(tmp_path):
    a = write_dataset(str(tmp_path / "a"), [6, 6])
    b = write_dataset(str(tmp_path / "b"), [6, 6], bad_every=1)  # unreadable: a draw from b shows as skips
    sources = "{" + a.replace("::", ",") + "}::{" + b.replace("::", ",") + "}"  # two sources, two shards each
    shards = validate_data(
        data_config(sources, dataset_resampled=True, train_data_upsampling_factors="1::3"), world_size=1
    )
    assert shards.weights == (1.0, 1.0, 3.0, 3.0)  # every shard carries its source's factor
    shard_of = draw_shard(shards, seed=0, epoch=0)
    counts = Counter(shard_of(d) for d in range(8000))
    assert abs(counts[2] + counts[3] - 6000) < 250  # 3/4 of the draws from the second source
    only_a = data_config(
        sources, dataset_resampled=True, train_data_upsampling_factors="1::0", train_num_samples=16
    )
    loader = build_train_loader(
        only_a, rank=0, world_size=1, seed=0, epoch=0, image_size=IMAGE_SIZE, tokenizer=TOKENIZER
    )
    assert sum(len(batch.keys) for batch in loader) == 16 and loader.stats.skipped_total == 0
    with pytest.raises(DataError, match="one non-negative number per '::' source"):
        validate_data(
            data_config(sources, dataset_resampled=True, train_data_upsampling_factors="1::2::3"),
            world_size=1,
        )
    with pytest.raises(ConfigError, match="needs --dataset-resampled"):
        data_config(sources, train_data_upsampling_factors="1::2").validate()
