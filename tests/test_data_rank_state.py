"""Each rank's own data state: what it costs at scale, and what it refuses.

Exact resume from these states is tested where the stream is (test_data_exact_resume.py: every
step, 2 ranks, from each rank's own state; test_data_resume.py: every rank's states merged, then
resumed at another world size). Here: the bytes one rank's state holds, built with the real
planner for a synthetic list of 1,024 shards at 16 and at 64 simulated ranks (no processes), must
not grow with the world, where the gathered position of every checkpoint before it grew linearly;
and the misuses a checkpoint's reader can make are refused in one line.
"""

from __future__ import annotations

import json

import pytest
from test_data_common import IMAGE_SIZE, TOKENIZER, data_config, write_dataset

from bigclip.data.loader import build_train_loader
from bigclip.data.resume.assignment import assign_readers
from bigclip.data.resume.position import DataPosition, RankProgress
from bigclip.data.resume.rank_state import RankState, continues_alone, merge_rank_states
from bigclip.data.resume.reader_state import OpenShardState, ReaderState
from bigclip.data.resume.spans import NO_STOP
from bigclip.data.resume.stream_state import RankStream, StreamSettings, StreamState
from bigclip.data.shards import ShardList
from bigclip.data.tar_samples import Cursor
from bigclip.errors import DataError

SHARDS, SHARD_SIZE, WORKERS, INTERLEAVE = 1024, 10_000, 4, 4  # every reader has 4 shards open at 64 ranks


def synthetic_shards() -> ShardList:
    urls = tuple(f"s3://laion/train/{i:05d}.tar" for i in range(SHARDS))
    return ShardList(pattern="s3://laion/train/{00000..01023}.tar", urls=urls, sizes=(SHARD_SIZE,) * SHARDS)


def mid_epoch_state(
    shards: ShardList, *, rank: int, world: int
) -> tuple[RankState, RankProgress, RankStream]:
    """Rank `rank`'s state with each reader `INTERLEAVE` shards into its plan, each 1,234 samples in
    (GB shards: byte offsets of ten digits), as the loader builds it."""
    settings = StreamSettings(world, WORKERS, 256, INTERLEAVE, 0)
    start = DataPosition.start_of(0, shards, resampled=False)
    assignment = assign_readers(shards, start, settings, rank=rank)
    progress, readers = RankProgress(), []
    for plan in assignment.tasks:
        opened = []
        for task in plan[:INTERLEAVE]:
            at = Cursor(task.start.index + 1234, 4_000_000_000 + task.shard)
            progress.cursors[(task.shard, task.start.index, NO_STOP if task.stop is None else task.stop)] = at
            progress.samples += 1234
            opened.append(OpenShardState(task.shard, task.start.index, task.stop, at, at, True))
        readers.append(ReaderState(1234 * len(opened), len(opened), 1234 * len(opened), 0, tuple(opened)))
    stream = RankStream(readers, list(range(WORKERS)), [])
    state = RankState.build(
        rank=rank, settings=settings, now=start.merge([progress]), samples=progress.samples * world,
        origin=assignment.origin, plans=assignment.tasks, readers=readers, stream=stream,
    )  # fmt: skip
    return state, progress, stream


def test_a_ranks_own_state_does_not_grow_with_the_world():
    shards = synthetic_shards()
    own, gathered = {}, {}
    for world in (16, 64):
        states = [mid_epoch_state(shards, rank=r, world=world) for r in range(world)]
        own[world] = max(len(json.dumps(s.to_json())) for s, _, _ in states)
        # What checkpoints held before: one position gathered from every rank, read by every rank.
        position = DataPosition.start_of(0, shards, resampled=False).merge([p for _, p, _ in states])
        settings = StreamSettings(world, WORKERS, 256, INTERLEAVE, 0)
        position.stream = StreamState(settings, {}, [stream for _, _, stream in states])
        gathered[world] = len(json.dumps(position.stream.to_json()))  # (beside a part O(shards))
        merged = merge_rank_states([s.to_json() for s, _, _ in states])
        assert merged == {k: v for k, v in position.to_json().items() if k != "stream"}
    assert own[64] <= own[16], own  # fewer shards per rank at 64: it even shrinks
    assert gathered[64] > 3 * gathered[16], gathered  # the old way: linear in the world, on every rank


@pytest.fixture(scope="module")
def dataset(module_tmp):
    return write_dataset(str(module_tmp("own")), [9, 7, 12])


def loader_for(pattern, *, workers, position=None):
    cfg = data_config(pattern, workers=workers, batch_size=2)
    return build_train_loader(cfg, rank=0, world_size=1, seed=1, epoch=0, image_size=IMAGE_SIZE,
                               tokenizer=TOKENIZER, position=position)  # fmt: skip


def state_after(pattern, *, steps, workers=0):
    loader = loader_for(pattern, workers=workers)
    for _ in zip(range(steps), loader):
        pass
    state = loader.rank_state()
    loader.close()
    return state


def test_an_own_state_continues_only_its_own_stream(dataset):
    state = state_after(dataset, steps=2)
    same = {"world_size": 1, "workers": 0, "batch_size": 2, "interleave": 2, "seed": 1}
    assert continues_alone(state, **same)
    assert not continues_alone(state, **same | {"workers": 1})
    assert not continues_alone(state, **same | {"world_size": 2})
    with pytest.raises(DataError, match="workers 0 -> 1.*merge every rank's state"):
        loader_for(dataset, workers=1, position=state)
    rest = [
        k for batch in loader_for(dataset, workers=1, position=merge_rank_states([state])) for k in batch.keys
    ]
    assert len(rest) == 9 + 7 + 12 - 2 * 2 - (9 + 7 + 12) % 2  # merged: re-planned, every sample once


def test_merging_refuses_a_partial_or_mixed_set_and_an_edited_state(dataset):
    state = state_after(dataset, steps=1)
    two = [json.loads(json.dumps(state)) for _ in range(2)]
    for rank, s in enumerate(two):
        s["rank"], s["settings"]["world_size"] = rank, 2
    with pytest.raises(DataError, match=r"ranks \[0\] were given, but the run that saved them had 2"):
        merge_rank_states(two[:1])
    later = state_after(dataset, steps=2) | {"rank": 1, "settings": two[1]["settings"]}
    with pytest.raises(DataError, match="not from one save"):
        merge_rank_states([two[0], later])
    with pytest.raises(DataError, match="malformed data rank state"):
        merge_rank_states([{**state, "plans": [[["x"]]]}])
