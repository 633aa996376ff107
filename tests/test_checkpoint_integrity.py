"""Integrity on load and save: every byte checked as it streams, damage never trained on or committed.

In one process (local folder and loopback S3): a flipped byte in a weight, a moment or `.metadata`
fails `load(PATH)` naming the object and tensor; `load("latest")` skips it for the newest intact
checkpoint in one warning line; NaN is refused on save (nothing written, latest unchanged) and
on load. With real ranks (gloo), FSDP2 and DeepSpeed ZeRO-3 engines save at 2 ranks and resume
at 3 from a checkpoint whose rank-1 shard is damaged.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch
from support.engine_harness import make_engine, run_steps
from test_engine_deepspeed import config

from bigclip.checkpoint import CheckpointStore
from bigclip.checkpoint.integrity import CheckpointDamaged, MemoryFile, zip_records
from bigclip.config import TrainConfig
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.errors import StorageError
from bigclip.storage.safe_metadata import load_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket("integrity-tests")
        yield server


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, s3) -> CheckpointStore:
    root = (
        str(tmp_path / "ckpt") if request.param == "local" else f"s3://integrity-tests/{uuid.uuid4().hex[:8]}"
    )
    store = CheckpointStore(root, io_threads=2)
    yield store
    store.close()


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g).bfloat16()},
        "optim": {"state": {"w": {"exp_avg": torch.randn(64, 32, generator=g), "step": torch.tensor(1.0)}}},
        "train": {"step": step},
    }


def stored_byte(store: CheckpointStore, folder: str, key: str) -> tuple[str, int]:
    """(object, offset) of the middle byte of `key`'s stored tensor bytes."""
    metadata = load_metadata(store.location.read_bytes(f"{folder}/.metadata"))
    info = next(v for i, v in metadata.storage_data.items() if i.fqn == key)
    data = store.location.read_bytes(f"{folder}/{info.relative_path}")
    zipped = memoryview(data)[info.offset : info.offset + info.length]
    record = next(r for r in zip_records(MemoryFile(zipped)) if r.is_storage)
    return f"{folder}/{info.relative_path}", info.offset + record.start + record.nbytes // 2


def flip(store: CheckpointStore, name: str, offset: int) -> None:
    data = bytearray(store.location.read_bytes(name))
    data[offset] ^= 0x01
    store.location.write_bytes(name, bytes(data))


def assert_state(got: dict, want: dict) -> None:
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(
        got["model"]["b"], want["model"]["b"]
    )
    assert torch.equal(got["optim"]["state"]["w"]["exp_avg"], want["optim"]["state"]["w"]["exp_avg"])
    assert got["train"] == want["train"]


@pytest.mark.parametrize("key", ["model.w", "model.b", "optim.state.w.exp_avg"])
def test_a_flipped_byte_fails_an_explicit_load_and_latest_skips_it(store, key, caplog):
    store.save(make_state(1), step=1)
    store.save(make_state(2), step=2)
    flip(store, *stored_byte(store, "step_00000002", key))
    explicit = store.location.child_uri("step_00000002")
    with pytest.raises(
        CheckpointDamaged,
        match=rf"step_00000002/([0-9a-f]+/)?__\d_\d\.distcp \(byte \d+\) is damaged: {key} .*CRC-32.*re-copy",
    ):
        store.load(make_state(0), explicit)
    target = make_state(0)
    with caplog.at_level(logging.WARNING, logger="bigclip.checkpoint"):
        manifest = store.load(target, "latest")
    assert manifest.step == 1
    assert_state(target, make_state(1))
    skipped = [r.getMessage() for r in caplog.records if "skipped damaged checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "\n" not in skipped[0]
    assert (
        explicit in skipped[0]
        and key in skipped[0]
        and store.location.child_uri("step_00000001") in skipped[0]
    )


def test_metadata_and_inventory_damage_are_skipped_by_latest_only(store):
    for step in (1, 2, 3, 4):
        store.save(make_state(step), step=step)
    # Rank 0's record (under its own prefix on S3); its DCP metadata is the record's last part.
    record = "step_00000004/" + next(
        n for n in store.location.list_files("step_00000004") if n.endswith("__0_rank.bigclip")
    )
    flip(store, record, len(store.location.read_bytes(record)) - 40)
    shard = next(n for n in store.location.list_files("step_00000003") if n.endswith(".distcp"))
    store.location.write_bytes(
        f"step_00000003/{shard}", store.location.read_bytes(f"step_00000003/{shard}")[:-1]
    )
    store.location.delete(f"step_00000002/{shard}")
    with pytest.raises(
        CheckpointDamaged, match=r"__0_rank\.bigclip: its metadata differs from what its writer"
    ):
        store.load(make_state(0), "step_00000004")
    with pytest.raises(CheckpointDamaged, match=r"step_00000002 is damaged: .*\.distcp: missing"):
        store.load(make_state(0), "step_00000002")
    target = make_state(0)
    assert store.load(target, "latest").step == 1
    assert_state(target, make_state(1))
    store.location.write_bytes("step_00000001/manifest.json", b"{not json")
    with pytest.raises(CheckpointDamaged, match="step_00000001/manifest.json is damaged"):
        store.load(make_state(0), "latest")  # every commit damaged: the oldest one's reason


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_state_with_nan_is_never_committed(store, mode):
    store.save(make_state(1), step=1)
    bad = make_state(2)
    bad["optim"]["state"]["w"]["exp_avg"][3, 4] = float("inf")
    save = store.save if mode == "sync" else store.async_save
    with pytest.raises(
        StorageError, match=r"step 2 refused: optim.state.w.exp_avg holds NaN or inf .*step_00000001"
    ):
        save(bad, step=2)
    assert store.latest() == store.location.child_uri("step_00000001")
    assert "step_00000002" not in store.location.list_folders()  # nothing written at all


def test_nan_saved_by_an_unchecking_writer_is_refused_on_load(store, monkeypatch):
    store.save(make_state(1), step=1)
    monkeypatch.setattr("bigclip.checkpoint.store.first_non_finite", lambda plain: None)
    bad = make_state(2)
    bad["model"]["w"][0, 0] = float("nan")
    store.save(bad, step=2)
    with pytest.raises(
        CheckpointDamaged, match=r"model.w holds NaN or inf although its bytes are as written"
    ):
        store.load(make_state(0), store.location.child_uri("step_00000002"))
    assert store.load(make_state(0), "latest").step == 1


# -- real ranks, both engines ------------------------------------------------------------------


def save_two(rank: int, world: int, cfg_dict: dict, root: str) -> dict | None:
    """Worker: train, commit step 1, train, commit step 2; rank 0 returns step 1's weights."""
    cfg = TrainConfig.from_dict(cfg_dict).validate()
    engine = make_engine(rank, world, cfg)
    store = CheckpointStore(root)
    run_steps(engine, cfg, range(1), 12)
    store.save(engine.checkpoint_state(), step=1)
    first = {k: v.clone() for k, v in engine.full_state_dict().items()}  # some are views of live params
    run_steps(engine, cfg, range(1, 2), 12)
    store.save(engine.checkpoint_state(), step=2)
    store.close()
    return first if rank == 0 else None


def resume_both_ways(rank: int, world: int, cfg_dict: dict, root: str, damaged: str) -> dict:
    """Worker: an explicit load of the damaged checkpoint fails on every rank; latest skips it."""
    cfg = TrainConfig.from_dict(cfg_dict).validate()
    engine = make_engine(rank, world, cfg)
    store = CheckpointStore(root)
    try:
        store.load(engine.checkpoint_state(), damaged)
        explicit = "loaded"
    except CheckpointDamaged as e:
        explicit = str(e)
    step = store.load(engine.checkpoint_state(), "latest").step
    weights = engine.full_state_dict()
    store.close()
    return {"explicit": explicit, "step": step, "weights": weights if rank == 0 else None}


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_ranks_resume_from_the_newest_intact_checkpoint(tmp_path, engine):
    root = tmp_path / "ckpt"
    first = spawn(save_two, 2, config(engine), str(root))[0]
    store = CheckpointStore(str(root))
    metadata = load_metadata(store.location.read_bytes("step_00000002/.metadata"))
    on_rank1 = [
        i.fqn
        for i, v in metadata.storage_data.items()
        if v.relative_path.startswith("__1_") and i.fqn.startswith("model.")
    ]
    key = max(on_rank1, key=lambda k: metadata.state_dict_metadata[k].size.numel())
    flip(store, *stored_byte(store, "step_00000002", key))  # saved by rank 1, read by some rank of 3
    out = spawn(resume_both_ways, 3, config(engine), str(root), str(root / "step_00000002"))
    assert all(key in r["explicit"] and "CRC-32" in r["explicit"] for r in out), [r["explicit"] for r in out]
    assert all(r["step"] == 1 for r in out)
    for name, tensor in first.items():
        assert torch.equal(out[0]["weights"][name], tensor), name
