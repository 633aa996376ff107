"""Exact continuation: resumed at the same settings, a loader yields what the uninterrupted one would have.

An uninterrupted loader takes its position after every step; on every rank, a fresh loader
is then built from each of those positions in turn and must yield the very same batches:
keys in order, image tensors bitwise (crops included: the images are random pixels, so any
other crop shows) and token ids, to the same last step, passing through the same positions.
Resuming from every step covers the cases that matter, and the test checks they occur: mid-
shard, a worker's short last batch waiting in the re-batcher, one partly consumed, workers
that have finished. The data has a compressed shard and corrupt samples.
"""

import logging
import random

import numpy as np
import pytest
import torch
from test_data_common import IMAGE_SIZE, TOKENIZER, data_config, noise_image_bytes, write_dataset

from bigclip.data.batching import WorkerOrder
from bigclip.data.decode import decode_image
from bigclip.data.loader import build_train_loader
from bigclip.data.resume.rank_state import merge_rank_states
from bigclip.data.transforms import train_transform
from bigclip.distributed import spawn
from bigclip.errors import DataError

SIZES = [13, 7, 22, 9, 16, 11, 5, 18, 10]  # unequal; one compressed, every 6th sample corrupt
BATCH = 4
SEED = 10


@pytest.fixture(scope="module")
def dataset(module_tmp):
    root = str(module_tmp("exact"))
    return write_dataset(root, SIZES, compressed=(3,), bad_every=6, textured=True)


def run_epoch(rank, world_size, pattern, *, workers, position=None, resampled=False, max_steps=0, own=False):
    """Batches (keys, images, texts), the position after each step, and the one after the loop;
    with `own`, this rank's own state (rank_state) in place of the gathered position."""
    cfg = data_config(
        pattern, workers=workers, batch_size=BATCH, dataset_resampled=resampled, train_num_samples=sum(SIZES)
    )
    loader = build_train_loader(
        cfg, rank=rank, world_size=world_size, seed=SEED, epoch=0, image_size=IMAGE_SIZE, tokenizer=TOKENIZER,
        position=position,
    )  # fmt: skip
    batches, positions = [], []
    stream = iter(loader)
    while not max_steps or loader.samples_consumed < max_steps * loader.global_batch:  # resume included
        batch = next(stream, None)
        if batch is None:
            break
        batches.append((batch.keys, batch.images, batch.texts))
        positions.append(loader.rank_state() if own else loader.state_dict())  # state_dict: collective
    loader.close()
    return batches, positions, loader.rank_state() if own else loader.state_dict()


def same_batches(a, b) -> bool:
    return len(a) == len(b) and all(
        ka == kb and torch.equal(ia, ib) and torch.equal(ta, tb) for (ka, ia, ta), (kb, ib, tb) in zip(a, b)
    )


def resume_from_every_step(rank, world_size, pattern, options, kinds=("position",)):
    """Worker: the uninterrupted epoch, then a resume from each of its positions (kind "position":
    the gathered ones; "own": each rank's own state); what differed."""
    batches, positions, final = run_epoch(rank, world_size, pattern, **options)
    own_states = (
        run_epoch(rank, world_size, pattern, own=True, **options)[1:] if "own" in kinds else ([], None)
    )
    differed = {}
    for kind, own, (saved, last) in (("position", False, (positions, final)), ("own", True, own_states)):
        for k, position in enumerate(saved if kind in kinds else [], start=1):
            rest, rest_saved, rest_last = run_epoch(
                rank, world_size, pattern, position=position, own=own, **options
            )
            checks = {"batches": same_batches(rest, batches[k:]), "saved": rest_saved == saved[k:],
                      "final": rest_last == last}  # fmt: skip
            if not all(checks.values()):
                differed[(kind, k)] = [name for name, ok in checks.items() if not ok]
    replanned = run_epoch(rank, world_size, pattern, position=strip_stream(positions[0]), **options)[0]
    return {
        "steps": len(batches),
        "differed": differed,
        "positions": positions,
        "own_states": own_states[0],
        "replanned_differs": not same_batches(replanned, batches[1:]),
    }


def strip_stream(position):
    return {k: v for k, v in position.items() if k != "stream"}


def stream_cases(positions, rank_count):
    """Steps after which a shard is partly read / some rank holds a short last batch / has used part of one."""
    cases = {"mid_shard": set(), "carry": set(), "split_carry": set()}
    for k, position in enumerate(positions, start=1):
        if position["cursors"]:
            cases["mid_shard"].add(k)
        for rank in position["stream"]["ranks"][:rank_count]:
            readers = rank["readers"]
            if rank["carry"]:
                cases["carry"].add(k)
            if any(readers[w][2] % BATCH for w in rank["carry"]):  # emitted count mid-batch: consumed in part
                cases["split_carry"].add(k)
    return cases


def test_crops_show_in_the_test_images():
    image = decode_image(noise_image_bytes(random.Random(0)))
    transform = train_transform(IMAGE_SIZE)
    assert not np.array_equal(transform(image, random.Random(1)), transform(image, random.Random(2)))


@pytest.mark.dist
@pytest.mark.parametrize(
    "workers, kinds", [(1, ("position",)), (2, ("own",)), (3, ("position", "own"))]
)  # resumed from the gathered position (as checkpoints before per-rank states), from each rank's own state
def test_resume_at_the_same_settings_continues_the_exact_stream(dataset, workers, kinds):
    results = spawn(resume_from_every_step, 2, dataset, {"workers": workers}, kinds, timeout_s=300)
    assert [r["differed"] for r in results] == [{}, {}]
    steps = results[0]["steps"]
    assert steps >= 8 and results[1]["steps"] == steps
    if "own" in kinds:  # every rank's own states merge into the gathered position, at every step
        for k, position in enumerate(results[0]["positions"]):
            merged = merge_rank_states([r["own_states"][k] for r in results])
            assert merged == strip_stream(position)
    assert all(r["replanned_differs"] for r in results)  # without the stream state the order changes
    cases = stream_cases(results[0]["positions"], 2)
    assert any(k < steps for k in cases["mid_shard"])
    if workers > 1:  # a worker ended with a short batch while another kept going
        assert any(k < steps for k in cases["carry"])
    if workers > 2:  # ...and that short batch was consumed in part, with steps to go
        assert any(k < steps for k in cases["split_carry"])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_resume_in_one_process_continues_the_exact_stream(dataset, workers):
    result = resume_from_every_step(0, 1, dataset, {"workers": workers}, ("position", "own"))
    assert result["differed"] == {} and result["steps"] >= 20 and result["replanned_differs"]


def test_a_replanned_stream_continues_exactly_from_its_own_origin(dataset):
    position = run_epoch(0, 1, dataset, workers=2, max_steps=3)[1][-1]
    batches, positions, final = run_epoch(0, 1, dataset, workers=1, position=position)  # re-planned
    assert positions[0]["stream"]["origin"]["samples"] == 3 * BATCH  # planned from there, not the epoch start
    for k in (1, 4):
        rest, rest_positions, rest_final = run_epoch(0, 1, dataset, workers=1, position=positions[k - 1])
        assert same_batches(rest, batches[k:]) and rest_positions == positions[k:] and rest_final == final


@pytest.mark.slow
def test_resampled_stream_continues_exactly_at_the_same_settings(dataset):
    options = {"workers": 2, "resampled": True, "max_steps": 12}
    result = resume_from_every_step(0, 1, dataset, options, ("position", "own"))
    assert result["differed"] == {} and result["steps"] == 12


def test_the_log_says_whether_the_stream_continues_and_why_not(dataset, caplog):
    position = run_epoch(0, 1, dataset, workers=2, max_steps=3)[1][-1]
    with caplog.at_level(logging.INFO, logger="bigclip.data"):
        run_epoch(0, 1, dataset, workers=2, position=position, max_steps=4)
        assert "continuing the saved stream exactly (epoch 0, 12 samples in)" in caplog.text
        rest = run_epoch(0, 1, dataset, workers=1, position=position)[0]
    assert "re-planning the rest of epoch 0" in caplog.text and "workers 2 -> 1" in caplog.text
    seen = [k for keys, _, _ in rest for k in keys]
    assert len(seen) == len(set(seen)) and rest


def test_malformed_stream_state_is_a_clear_error(dataset):
    position = run_epoch(0, 1, dataset, workers=1, max_steps=1)[1][-1]
    position["stream"]["ranks"][0]["active"] = [0, 0]
    with pytest.raises(DataError, match="malformed stream state"):
        run_epoch(0, 1, dataset, workers=1, position=position)


def tagged(worker, n, *, last=False):
    return {"worker": worker, "n": n, "last": last}


def test_worker_order_is_round_robin_whatever_order_batches_arrive_in():
    arrivals = [tagged(1, 0), tagged(2, 0, last=True), tagged(0, 0), tagged(1, 1, last=True), tagged(0, 1)]
    arrivals.append(tagged(0, 2, last=True))
    order = WorkerOrder(iter(arrivals), active=[0, 1, 2])
    assert [(b["worker"], b["n"]) for b in order] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2)]
    with pytest.raises(RuntimeError, match="data worker 1 stopped without sending its last batch"):
        list(WorkerOrder(iter([tagged(0, 0, last=True)]), active=[1, 0]))
