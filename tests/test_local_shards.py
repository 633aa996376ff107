"""`LocalShards` through torch.distributed.checkpoint in one process: what DCP does with it.

A 5 x 7 tensor held as row-major ranges (a rank's fragments, as ZeRO cuts them) is saved, read
back whole the reference way, loaded in place into another cut of ranges (also planned from only
the saved chunks it overlaps, as a rank-local load driver plans), staged to CPU by DCP's async
stager, and checked for NaN by the store's finite check. (Several ranks, DeepSpeed and
the old builder: tests/test_engine_deepspeed_checkpoint.py.)
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_harness import whole_checkpoint
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from bigclip.checkpoint.finite import first_non_finite
from bigclip.engines.deepspeed_layout import flat_boxes
from bigclip.engines.local_shards import LocalShards

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SHAPE = (5, 7)


def ranges_of(flat: torch.Tensor, cuts: list[int]) -> LocalShards:
    """`flat` (the whole tensor, row-major) as the boxes of the ranges between `cuts`, views of it."""
    shards, offsets = [], []
    for start, end in zip(cuts, cuts[1:]):
        pos = start
        for corner, sizes in flat_boxes(SHAPE, start, end):
            n = torch.Size(sizes).numel()
            shards.append(flat[pos : pos + n].view(sizes))
            offsets.append(corner)
            pos += n
    return LocalShards(shards, offsets, size=SHAPE, dtype=flat.dtype, device=flat.device)


def test_saved_whole_and_loaded_in_place_into_another_cut(tmp_path):
    values = torch.arange(35, dtype=torch.float32)
    saved = ranges_of(values.clone(), [0, 12, 20, 35])  # 12 and 20 fall inside rows
    assert len(saved.__create_chunk_list__()) > 3
    dcp.save({"w": saved, "step": 3}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(whole_checkpoint(tmp_path / "ckpt")["w"], values.view(SHAPE))

    target = torch.zeros(35)
    state = {"w": ranges_of(target, [0, 3, 30, 35]), "step": 0}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(target, values)  # the shards are views: DCP wrote into `target`
    assert state["step"] == 3


def test_async_stager_copies_it_to_cpu_memory_of_its_own(tmp_path):
    values = torch.arange(35, dtype=torch.float32)
    live = values.clone()
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = stager.stage({"w": ranges_of(live, [0, 9, 35])})
    stager.close()
    live.zero_()  # training goes on after staging
    assert isinstance(staged["w"], LocalShards) and staged["w"].shape == SHAPE
    dcp.save(staged, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(whole_checkpoint(tmp_path / "ckpt")["w"], values.view(SHAPE))


def test_a_rank_plans_its_load_from_the_saved_chunks_it_overlaps(tmp_path):
    """A rank-local load driver hands DCP's load planner only the saved chunks that overlap this
    rank's boxes (`__create_chunk_list__`): it plans the same reads as from all of them."""
    dcp.save(
        {"w": ranges_of(torch.arange(35.0), [0, 6, 12, 20, 35])}, checkpoint_id=str(tmp_path), no_dist=True
    )
    metadata = FileSystemReader(str(tmp_path)).read_metadata()
    mine = ranges_of(torch.zeros(35), [14, 23])
    saved = metadata.state_dict_metadata["w"]
    relevant = [c for c in saved.chunks if any(_overlap(c, m) for m in mine.__create_chunk_list__())]
    assert 0 < len(relevant) < len(saved.chunks)
    only_mine = Metadata({"w": TensorStorageMetadata(saved.properties, saved.size, relevant)})

    def reads(md: Metadata) -> list:
        planner = DefaultLoadPlanner()
        planner.set_up_planner({"w": mine}, md, False)
        return planner.create_local_plan().items

    assert reads(only_mine) == reads(metadata) != []


def _overlap(a, b) -> bool:
    return all(
        oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_shards_stage_through_pinned_memory_and_load_in_place(tmp_path):
    """As the store stages on a GPU: pinned CPU buffers, non-blocking copies."""
    values = torch.arange(35, dtype=torch.float32)
    live = values.cuda()
    stager = DefaultStager(StagingOptions(True, False, False, True))
    staged = stager.stage({"w": ranges_of(live, [0, 9, 35])})
    live.zero_()
    assert staged["w"].device.type == "cpu" and staged["w"].local_shards()[0].tensor.is_pinned()
    dcp.save(staged, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    stager.close()
    dcp.load({"w": ranges_of(live, [0, 20, 35])}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(live.cpu(), values)


def test_finite_check_sees_the_shards():
    flat = torch.arange(35, dtype=torch.float32)
    flat[33] = float("nan")
    assert first_non_finite({"model": {"w": ranges_of(flat, [0, 35])}}) == "model.w"
    assert first_non_finite({"model": {"w": ranges_of(flat, [0, 30])}}) is None


def test_only_checkpointing_operations():
    entry = ranges_of(torch.arange(35.0), [0, 35])
    assert isinstance(entry.detach(), LocalShards)
    copy = pickle.loads(pickle.dumps(entry))  # as process-based async staging would send it
    assert [s.offsets for s in copy.local_shards()] == [s.offsets for s in entry.local_shards()]
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(copy.local_shards(), entry.local_shards()))
    assert entry.to(torch.float64).local_shards()[0].tensor.dtype == torch.float64
    with pytest.raises(NotImplementedError, match="only this rank's boxes of a \\(5, 7\\) tensor"):
        entry + 1


@pytest.mark.parametrize(
    ("shard", "offsets", "message"),
    [
        (torch.zeros(2, 7), (4, 0), "lies outside"),
        (torch.zeros(14), (0,), "does not fit"),
        (torch.zeros(1, 7, dtype=torch.float64), (0, 0), "does not fit"),
    ],
)
def test_boxes_must_fit_the_tensor(shard, offsets, message):
    with pytest.raises(ValueError, match=message):
        LocalShards([shard], [offsets], size=SHAPE, dtype=torch.float32, device="cpu")
