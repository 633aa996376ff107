"""CheckpointStore in one process, on a local folder and on the loopback S3 server alike."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.legacy_checkpoint import save_legacy

from bigclip.checkpoint import CheckpointStore, keep_last_for, rank_record
from bigclip.checkpoint.manifest import MANIFEST_NAME
from bigclip.config import CheckpointConfig, TrainConfig
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.errors import StorageError
from bigclip.storage.redact import REDACTED, redact

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket("store-tests")
        yield server


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path, s3) -> str:
    if request.param == "local":
        return str(tmp_path / "checkpoints")
    return f"s3://store-tests/{uuid.uuid4().hex[:8]}/checkpoints"


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(33, 17, generator=g), "b": torch.randn(5, generator=g).bfloat16()},
        "optim": {
            "state": {"w": {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(33, 17, generator=g)}}
        },
        "train": {
            "step": seed,
            "epoch": seed // 2,
            "lr": 0.5 / (seed + 1),
            "data": {"shard": f"{seed:05d}.tar", "offsets": [seed, seed + 1]},
            "rng": torch.Generator().manual_seed(seed).get_state(),
        },
        "samples_seen": 1000 * seed,
    }


def assert_same(got: object, want: object) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            assert_same(got[key], want[key])
    else:
        assert got == want


def test_save_then_load_restores_tensors_and_plain_values_in_place(root, s3):
    store = CheckpointStore(root)
    uri = store.save(make_state(3), step=3, meta={"model": "tiny", "engine": "fsdp"})
    target = make_state(0)
    manifest = store.load(target, "latest")
    assert_same(target, make_state(3))
    assert (manifest.step, manifest.world_size, manifest.model, manifest.engine) == (3, 1, "tiny", "fsdp")
    assert manifest.uri == uri == store.latest()
    assert uri.endswith("/step_00000003")


def test_manifest_is_written_last_and_lists_every_object_with_its_checksum(root, s3):
    store = CheckpointStore(root)
    uri = store.save(make_state(1), step=1, meta={"model": "tiny", "epoch": 0})
    files = store.location.list_files("step_00000001")
    manifest = json.loads(store.location.read_bytes(f"step_00000001/{MANIFEST_NAME}"))
    assert set(manifest["objects"]) == set(files) - {MANIFEST_NAME}
    assert ".metadata" in manifest["objects"]
    for name, record in manifest["objects"].items():
        content = store.location.read_bytes(f"step_00000001/{name}")
        assert record == {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    assert manifest["meta"] == {"model": "tiny", "epoch": 0}
    assert store.verify(uri).step == 1


def test_latest_and_load_ignore_an_interrupted_save(root, s3):
    store = CheckpointStore(root)
    store.save(make_state(1), step=1)
    # A save cut short after its data and DCP metadata, before the manifest: what a crash leaves.
    writer, _ = store.location.dcp_writer("step_00000002", threads=1)
    dcp.save(make_state(2), storage_writer=writer, no_dist=True)
    assert store.latest() == store.location.child_uri("step_00000001")
    target = make_state(0)
    assert store.load(target, "latest").step == 1
    assert_same(target, make_state(1))
    with pytest.raises(StorageError, match="not a committed checkpoint"):
        store.load(make_state(0), store.location.child_uri("step_00000002"))


def test_load_from_a_run_root_or_a_folder_name(root, s3):
    store = CheckpointStore(root)
    store.save(make_state(4), step=4)
    store.save(make_state(7), step=7)
    other = CheckpointStore(root + "-elsewhere")
    target = make_state(0)
    assert other.load(target, root).step == 7
    assert_same(target, make_state(7))
    assert store.load(target, "step_00000004").step == 4  # a folder name under the root
    assert_same(target, make_state(4))


def test_nothing_committed_is_a_clear_error(root, s3):
    store = CheckpointStore(root)
    assert store.latest() is None
    with pytest.raises(StorageError, match="no committed checkpoint"):
        store.load(make_state(0), "latest")


def test_saving_a_step_again_replaces_it(root, s3):
    store = CheckpointStore(root, io_threads=1)
    store.save(make_state(5), step=5)
    store.save(make_state(6), step=5)
    target = make_state(0)
    store.load(target, "latest")
    assert_same(target["model"], make_state(6)["model"])
    assert store.committed() == [(5, store.location.child_uri("step_00000005"))]


def test_damaged_checkpoint_is_refused(root, s3):
    store = CheckpointStore(root, io_threads=1)
    store.save(make_state(2), step=2)
    # A rank's objects lie flat locally and under its own prefix on S3 (step_N/<hex>/__0_0.distcp).
    shard = next(
        f"step_00000002/{n}" for n in store.location.list_files("step_00000002") if n.endswith("__0_0.distcp")
    )
    content = bytearray(store.location.read_bytes(shard))
    content[len(content) // 2] ^= 0xFF  # same size, different bytes: only checksums see it
    store.location.write_bytes(shard, bytes(content))
    with pytest.raises(StorageError, match="__0_0.distcp: content differs"):
        store.verify("latest")
    with pytest.raises(StorageError, match=r"__0_0.distcp \(byte \d+\) is damaged: "):
        store.load(make_state(0), "latest")  # loading checks the bytes it reads, too
    store.location.write_bytes(shard, bytes(content[:-10]))  # truncated: the size check sees it
    with pytest.raises(StorageError, match=r"damaged: .*__0_0.distcp: \d+ bytes, manifest says"):
        store.load(make_state(0), "latest")


def test_another_models_checkpoint_lists_the_mismatched_keys(root, s3):
    store = CheckpointStore(root)
    store.save({"model": {"visual.proj": torch.zeros(8, 4), "text.proj": torch.zeros(4)}}, step=1)
    other_model = {"model": {"visual.proj": torch.zeros(16, 4), "logit_scale": torch.zeros(1)}}
    with pytest.raises(StorageError) as error:
        store.load(other_model, "latest")
    message = str(error.value)
    assert "missing from the checkpoint (1):\n    model.logit_scale" in message
    assert "model.visual.proj: checkpoint (8, 4) vs model (16, 4)" in message
    assert "in the checkpoint but not requested (1):\n    model.text.proj" in message


class RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (os.system, ("touch ran-code-from-checkpoint",))


def test_loading_never_runs_code_planted_in_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save({"model": {"w": torch.ones(2)}, "train": {"payload": RunsCodeWhenUnpickled()}}, step=1)
    with pytest.raises(StorageError, match="train.payload.*not plain data"):
        store.load({"model": {"w": torch.zeros(2)}, "train": {"payload": None}}, "latest")
    # A classic pickle exploit as a rank record's DCP metadata, sealed and listed to match it.
    forge_rank_record(tmp_path / "ckpt" / "step_00000001", EXPLOIT)
    with pytest.raises(StorageError, match="__0_rank.bigclip: checkpoint metadata refers to os.system"):
        store.load({"model": {"w": torch.zeros(2)}}, "latest")
    # The same as the global .metadata of a checkpoint saved before rank records.
    save_legacy(store, {"model": {"w": torch.ones(2)}}, step=2)
    forge_metadata(tmp_path / "ckpt" / "step_00000002", EXPLOIT)
    # The unpickler's own error, not DCP's "metadata is None" (torch 2.11 drops the cause).
    with pytest.raises(StorageError, match="^checkpoint metadata refers to os.system"):
        store.load({"model": {"w": torch.zeros(2)}}, "step_00000002")
    assert not (tmp_path / "ran-code-from-checkpoint").exists()


EXPLOIT = b"cos\nsystem\n(S'touch ran-code-from-checkpoint'\ntR."


def forge_rank_record(folder, metadata: bytes) -> None:
    """Replace rank 0's record's metadata with `metadata`, sealed and listed to match it."""
    text = json.dumps({"train": None}).encode()
    digests = hashlib.sha256(text).digest() + hashlib.sha256(metadata).digest()
    record = rank_record.MAGIC + struct.pack("<QQ", len(text), len(metadata)) + digests + text + metadata
    (folder / "__0_rank.bigclip").write_bytes(record)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["objects"]["__0_rank.bigclip"] = {
        "size": len(record),
        "sha256": hashlib.sha256(record).hexdigest(),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def forge_metadata(folder, content: bytes) -> None:
    """Replace a checkpoint's `.metadata`, with its manifest forged to match."""
    (folder / ".metadata").write_bytes(content)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["objects"][".metadata"] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_refused_metadata_is_not_replaced_by_a_planted_rank_local_one(tmp_path, monkeypatch):
    # DCP falls back to `__0.metadata` when `.metadata` cannot be read; a tampered checkpoint
    # must be refused, not loaded from a file the attacker planted next to it.
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    save_legacy(store, {"w": torch.ones(2)}, step=1)  # rank records are never read through DCP's fallback
    folder = tmp_path / "ckpt" / "step_00000001"
    (folder / "__0.metadata").write_bytes((folder / ".metadata").read_bytes())
    forge_metadata(folder, EXPLOIT)
    with pytest.raises(StorageError, match="^checkpoint metadata refers to os.system"):
        store.load({"w": torch.zeros(2)}, "latest")
    forge_metadata(folder, b"\x80\x05not a pickle at all")
    with pytest.raises(StorageError, match="^checkpoint .metadata is not readable DCP metadata.*damaged"):
        store.load({"w": torch.zeros(2)}, "latest")
    assert not (tmp_path / "ran-code-from-checkpoint").exists()


def test_retention_keeps_the_newest_commits_and_saves_in_flight(root, s3):
    store = CheckpointStore(root)
    for step in (1, 2, 3, 4):
        store.save({"w": torch.full((3,), float(step))}, step=step)
    for step in (0, 9):  # interrupted saves: one older than the newest commit, one newer (in flight)
        writer, _ = store.location.dcp_writer(f"step_{step:08d}", threads=1)
        dcp.save({"w": torch.zeros(3)}, storage_writer=writer, no_dist=True)
    deleted = store.apply_retention(keep_last=2)
    assert sorted(deleted) == sorted(store.location.child_uri(f"step_{s:08d}") for s in (0, 1, 2))
    assert [step for step, _ in store.committed()] == [4, 3]
    assert "step_00000009" in store.location.list_folders()
    assert store.apply_retention(keep_last=0) == []  # 0 keeps everything


def test_keep_last_applies_after_every_commit_and_never_drops_the_newest(root, s3):
    store = CheckpointStore(root, keep_last=1)
    for step in (10, 20, 30):
        store.save({"w": torch.full((3,), float(step))}, step=step)
        assert [s for s, _ in store.committed()] == [step]


def test_retention_flags_follow_openclip_semantics():
    cfg = CheckpointConfig(keep_last=3, remote_keep_last=5)
    assert keep_last_for(cfg, "/runs/a/checkpoints") == 3
    assert keep_last_for(cfg, "s3://bucket/a/checkpoints") == 5
    assert keep_last_for(CheckpointConfig(delete_previous_checkpoint=True), "/runs/a") == 1
    assert keep_last_for(CheckpointConfig(delete_previous_checkpoint=True), "s3://bucket/a") == 0


def test_async_save_snapshots_the_state_and_commits_in_the_background(root, s3):
    store = CheckpointStore(root)
    state = make_state(8)
    pending = store.async_save(state, step=8)
    state["model"]["w"].add_(1.0)  # training goes on while the upload runs
    assert pending.wait() == store.location.child_uri("step_00000008")
    assert pending.done() and pending.error is None and pending.blocked_s >= 0
    target = make_state(0)
    store.load(target, "latest")
    assert_same(target["model"], make_state(8)["model"])
    store.close()


def test_no_credential_reaches_manifests_or_logs(root, s3, monkeypatch, caplog):
    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)  # the loopback server accepts any key
    caplog.set_level(logging.DEBUG)
    store = CheckpointStore(root)
    store.check_access()
    config = {
        "checkpoint": {"s3_endpoint": f"http://admin:{secret}@127.0.0.1:9000"},
        "aws_secret_access_key": secret,
    }
    store.save(make_state(1), step=1, meta={"config": config, "note": f"key={secret}"})
    store.load(make_state(0), "latest")
    manifest = store.location.read_bytes(f"step_00000001/{MANIFEST_NAME}").decode()
    assert secret not in manifest and REDACTED in manifest
    assert secret not in caplog.text


def test_config_dump_is_redacted(monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token-value-123")
    cfg = TrainConfig()
    cfg.checkpoint.s3_endpoint = "https://minio-user:minio-password@minio.internal:9000"
    cfg.log.name = "run-session-token-value-123"
    dumped = json.dumps(redact(cfg.to_dict()))
    assert "minio-password" not in dumped and "session-token-value-123" not in dumped
    assert redact(TrainConfig().to_dict()) == TrainConfig().to_dict()  # nothing else touched


def test_redact_keeps_ordinary_config_fields():
    config = {"tokenizer": "simple", "lr": 0.1, "remote_sync": "s3://b/runs", "api_key": "", "password": "pw"}
    assert redact(config, secrets=[]) == {**config, "password": REDACTED}
