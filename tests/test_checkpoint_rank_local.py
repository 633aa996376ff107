"""Rank-local saves and loads: the same checkpoint DCP's coordinator writes, at O(1) per rank.

A save plans each rank alone and rank 0 only joins every rank's piece of `.metadata`
(checkpoint/rank_local_save.py, save_commit.py, metadata_stream.py); a load reads the records of
the saved ranks a rank overlaps (rank_local_load.py). Checked here:
- with real FSDP2 ranks, the `.metadata` is DCP's own (the coordinator's, from the same state),
  stock DCP reads it without bigclip, and each rank's record holds exactly the chunks the
  planner's simulation (plan/checkpoint_sim.py) gives it, so the scale figures rest on the real
  layout;
- counted at 16 and 64 simulated ranks: a rank's piece and record, the records a resuming rank
  reads (same world size and resharded), and the pieces rank 0 receives on a later save do not
  grow with the world size.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from support.engine_harness import make_engine, run_steps, tiny_config
from support.legacy_checkpoint import save_legacy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from bigclip.checkpoint import CheckpointStore, metadata_stream, rank_record
from bigclip.checkpoint.rank_local_load import merge, ranks_to_read, uncovered
from bigclip.checkpoint.save_commit import PieceCache
from bigclip.distributed import spawn
from bigclip.plan.checkpoint_sim import rank_chunks, rank_metadata
from bigclip.storage.locations import open_location

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

BIGISH = {  # ViT-bigG-14's kinds of shape at a small width: rows > world, rows < world, 0-dim
    "visual.conv1.weight": (64, 3, 14, 14),
    "visual.transformer.resblocks.0.attn.in_proj_weight": (192, 64),
    "visual.transformer.resblocks.0.mlp.c_proj.weight": (64, 256),
    "visual.transformer.resblocks.0.ln_1.bias": (64,),
    "positional_embedding": (77, 64),
    "logit_scale": (),
}


def _save_both(rank: int, world: int, root: str) -> dict:
    cfg = tiny_config()
    engine = make_engine(rank, world, cfg)
    run_steps(engine, cfg, range(1), batch=6)
    store = CheckpointStore(f"{root}/rank_local")
    store.save(engine.checkpoint_state(), step=1, rank_state={"rank": rank})
    save_legacy(CheckpointStore(f"{root}/coordinated"), engine.checkpoint_state(), step=1)
    return {
        "shapes": engine.full_param_shapes(),
        "train": store.rank_state(store.load(engine.checkpoint_state()), rank),
    }


@pytest.mark.dist
def test_rank_local_save_writes_the_coordinators_metadata_and_stock_dcp_reads_it(tmp_path) -> None:
    world = 3
    results = spawn(_save_both, world, str(tmp_path))
    ours = FileSystemReader(tmp_path / "rank_local" / "step_00000001").read_metadata()
    theirs = FileSystemReader(tmp_path / "coordinated" / "step_00000001").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata  # keys, sizes, dtypes, chunks in order
    assert set(ours.storage_data) == set(theirs.storage_data)
    assert ours.planner_data == theirs.planner_data
    dcp_to_torch_save(tmp_path / "rank_local" / "step_00000001", tmp_path / "ours.pt")  # no bigclip
    dcp_to_torch_save(tmp_path / "coordinated" / "step_00000001", tmp_path / "theirs.pt")
    a, b = (
        torch.load(tmp_path / "ours.pt", weights_only=True),
        torch.load(tmp_path / "theirs.pt", weights_only=True),
    )
    assert a.keys() == b.keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert [r["train"] for r in results] == [{"rank": r} for r in range(world)]  # each rank's own, read back
    # The simulation's chunks of each saved rank are the real ones.
    shapes = results[0]["shapes"]
    location = open_location(str(tmp_path / "rank_local"))
    for rank in range(world):
        record = rank_record.record_of("", rank, world)
        real = rank_record.read_metadata(location, "step_00000001", record)[0].state_dict_metadata
        sim = rank_metadata(shapes, engine="fsdp", world=world, rank=rank).state_dict_metadata
        for key, value in sim.items():
            if hasattr(value, "chunks") and key in real:
                assert real[key].chunks == value.chunks, key
        assert set(real) <= set(sim)  # rank 0's record holds every key; the others their shards


def test_pieces_of_over_a_thousand_records_join_into_the_coordinators_metadata() -> None:
    """Pickle writes a list or dict's items in batches of a thousand (a lone one by itself), and a
    piece carries them as pickle wrote them: the joined file is what DCP's coordinator makes of
    the same ranks' plans, whatever the batches (1,200 storage records on rank 1)."""
    shapes = {f"visual.p{i}.weight": (5, 3) for i in range(400)} | {"visual.lone": (1,)}
    metas = [rank_metadata(shapes, engine="fsdp", world=3, rank=r) for r in range(3)]
    keys = metadata_stream.tensor_keys(metas[0])
    head, _ = metadata_stream.skeleton(metas[0])
    ours = pickle.loads(metadata_stream.assemble(head, [metadata_stream.rank_piece(m, keys) for m in metas]))
    plans = [SavePlan(_write_items(m), planner_data=m.planner_data) for m in metas]
    _, theirs = create_default_global_save_plan(plans)
    assert len(metas[1].storage_data) > 1000
    assert ours.state_dict_metadata == theirs.state_dict_metadata  # every chunk list, in rank order
    assert ours.storage_data == {i: s for m in metas for i, s in m.storage_data.items()}


def _write_items(meta: Metadata) -> list[WriteItem]:
    """The write items a rank's plan held, back from its metadata."""
    items = []
    for key, value in meta.state_dict_metadata.items():
        if not hasattr(value, "chunks"):
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        for chunk in getattr(value, "chunks", []):
            data = TensorWriteData(chunk=chunk, properties=value.properties, size=value.size)
            items.append(
                WriteItem(index=MetadataIndex(key, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)
            )
    return items


def _reads(world: int, loading: int, rank: int, rank0: object) -> set[int]:
    """The saved ranks a loading rank reads, its chunks as FSDP2 splits them at `loading` ranks."""
    wanted = {}
    for key, value in rank0.state_dict_metadata.items():
        if hasattr(value, "chunks"):
            shape = tuple(value.size)
            boxes = rank_chunks(shape, engine="fsdp", world=loading, rank=rank) if shape else [([], [])]
            wanted[key] = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        else:
            wanted[key] = None
    found = ranks_to_read(wanted, rank0, saved_world=world)
    metas = [rank_metadata(BIGISH, engine="fsdp", world=world, rank=k) for k in sorted(found)]
    assert not uncovered(wanted, merge(metas)), "the records read must cover what the rank loads"
    return found


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_what_a_rank_writes_and_reads_does_not_grow_with_the_world(engine: str) -> None:
    piece, record, same, resharded = {}, {}, {}, {}
    for world in (16, 64):
        rank1 = rank_metadata(BIGISH, engine=engine, world=world, rank=1)
        keys = metadata_stream.tensor_keys(rank_metadata(BIGISH, engine=engine, world=world, rank=0))
        piece[world] = len(metadata_stream.rank_piece(rank1, keys))
        record[world] = len(pickle.dumps(rank1))
        if engine == "fsdp":
            rank0 = rank_metadata(BIGISH, engine=engine, world=world, rank=0)
            same[world] = max(len(_reads(world, world, r, rank0)) for r in range(world))
            resharded[world] = max(
                len(_reads(world, world * 3 // 4, r, rank0)) for r in range(world * 3 // 4)
            )
    assert piece[64] <= piece[16] * 1.05 and record[64] <= record[16] * 1.05
    if same:
        assert same == {16: 2, 64: 2}  # its own record and rank 0's
        # Resharded: for each distinct row count, the one or two saved ranks holding those rows.
        bound = 1 + 2 * len({shape[0] for shape in BIGISH.values() if shape})
        assert resharded[16] <= bound and resharded[64] <= bound


def test_rank_0_receives_no_piece_twice() -> None:
    cache, digests = PieceCache(), [f"d{r}" for r in range(64)]
    assert cache.missing(digests) == list(range(64))
    cache.update(digests, [b"piece"] * 64)
    assert cache.missing(digests) == []  # a later save: nothing crosses the network
    digests[5] = "changed"
    assert cache.missing(digests) == [5]


def test_a_checkpoint_saved_before_rank_records_still_loads(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path))
    state = {"model": {"w": torch.arange(6.0)}, "train": {"step": 3, "rng": "[1]", "data": "null"}}
    save_legacy(store, state, step=3)
    target = {"model": {"w": torch.zeros(6)}, "train": {"step": 0, "rng": "", "data": ""}}
    manifest = store.load(target, "latest", optional_keys=("train.rng", "train.data"))
    assert manifest.layout == "" and store.rank_state(manifest, 0) is None
    assert torch.equal(target["model"]["w"], torch.arange(6.0)) and target["train"]["rng"] == "[1]"
    store.save({"model": {"w": torch.ones(6)}, "train": {"step": 4}}, step=4, rank_state={"rng": 7})
    target = {"model": {"w": torch.zeros(6)}, "train": {"step": 0, "rng": "", "data": ""}}
    manifest = store.load(target, "latest", optional_keys=("train.rng", "train.data"))
    assert target["train"] == {"step": 4, "rng": "", "data": ""}  # placeholders left as they were
    assert store.rank_state(manifest, 0) == {"rng": 7}
