"""Committed checkpoints copied to a remote location: whole or not at all, unchanged bytes not
sent again, local pruning waits for the copy, earlier attempts' remote logs never overwritten."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from support.s3_fault_proxy import FaultProxy

from bigclip.checkpoint import CheckpointStore
from bigclip.checkpoint.mirror import CheckpointMirror
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.storage.locations import LocalLocation, Location, open_location
from bigclip.storage.settings import storage_configured
from bigclip.train.remote_sync import RemoteSync

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
BUCKET = "mirror-tests"


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket(BUCKET)
        yield server


def state(step: int, *, frozen_seed: int = 0) -> dict:
    """A 'frozen' tensor that never changes and a trained one that does, each in its own file."""
    return {
        "frozen": torch.randn(256, 256, generator=torch.Generator().manual_seed(frozen_seed)),
        "trained": torch.randn(256, 256, generator=torch.Generator().manual_seed(1000 + step)),
    }


def save(root: Path, *steps: int) -> CheckpointStore:
    store = CheckpointStore(str(root), io_threads=2)  # rank 0 writes two files: frozen, trained
    for step in steps:
        store.save(state(step), step=step)
    return store


def remote(s3: LoopbackS3, prefix: str) -> Location:
    """As the remote sync opens its target: fork-safe (boto3), few tries per request."""
    return open_location(f"s3://{BUCKET}/{prefix}", fork_safe=True, max_attempts=3)


def test_committed_checkpoints_are_copied_whole_and_unchanged_bytes_are_not_sent(tmp_path, s3):
    save(tmp_path / "ckpt", 1, 2)
    target = remote(s3, f"{uuid.uuid4().hex[:8]}/checkpoints")
    mirror = CheckpointMirror(LocalLocation(tmp_path / "ckpt"), target)
    reports = {r.step: r for r in mirror.sync()}
    assert sorted(reports) == [1, 2]
    newest_first = reports[2]  # copied first: nothing was remote yet
    assert newest_first.uploaded_bytes == newest_first.total_bytes and newest_first.copied_bytes == 0
    older = reports[1]  # the frozen tensor's file is already remote: copied server-side
    assert (
        0 < older.copied_bytes < older.total_bytes
        and older.uploaded_bytes + older.copied_bytes == older.total_bytes
    )
    assert mirror.sync() == []  # nothing new: nothing sent
    loaded = state(0, frozen_seed=5)
    remote_store = CheckpointStore(target.uri)
    assert remote_store.load(loaded, "latest").step == 2  # read straight from S3
    assert all(torch.equal(loaded[k], v) for k, v in state(2).items())
    remote_store.verify(f"{target.uri}/step_00000001")  # every object's SHA-256 matches


def test_local_pruning_waits_for_the_copy_and_the_remote_keeps_all(tmp_path, s3):
    target = remote(s3, f"{uuid.uuid4().hex[:8]}/checkpoints")
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=1)
    mirror = CheckpointMirror(store.location, target)
    store.keep = mirror.needed
    for step in (1, 2, 3):
        store.save(state(step), step=step)
    assert [s for s, _ in store.committed()] == [3, 2, 1]  # nothing copied yet: nothing pruned
    mirror.sync()
    store.save(state(4), step=4)  # retention runs after this commit
    assert [s for s, _ in store.committed()] == [4]
    mirror.sync()
    assert [s for s, _ in CheckpointStore(target.uri).committed()] == [4, 3, 2, 1]


def test_remote_keep_last_prunes_only_the_remote(tmp_path, s3):
    target = remote(s3, f"{uuid.uuid4().hex[:8]}/checkpoints")
    store = save(tmp_path / "ckpt", 1, 2, 3)
    CheckpointMirror(store.location, target, keep_last=2).sync()
    assert [s for s, _ in CheckpointStore(target.uri).committed()] == [3, 2]
    assert [s for s, _ in store.committed()] == [3, 2, 1]


def test_a_checkpoint_can_be_resumed_from_an_fsspec_copy(tmp_path):
    save(tmp_path / "ckpt", 1)
    uri = f"memory://mirror-{uuid.uuid4().hex[:8]}/checkpoints"
    from bigclip.storage.fsspec_location import FsspecLocation

    CheckpointMirror(LocalLocation(tmp_path / "ckpt"), FsspecLocation(uri)).sync()
    assert fsspec.filesystem("memory").exists(f"{uri[len('memory://') :]}/step_00000001/manifest.json")
    loaded = state(0, frozen_seed=5)
    assert CheckpointStore(str(tmp_path / "elsewhere")).load(loaded, f"{uri}/step_00000001").step == 1
    assert torch.equal(loaded["trained"], state(1)["trained"])


_MIRROR_SCRIPT = textwrap.dedent(
    """
    import sys
    from bigclip.checkpoint.mirror import CheckpointMirror
    from bigclip.storage.locations import LocalLocation, open_location
    from bigclip.storage.settings import configure_storage
    local, uri, endpoint = sys.argv[1:]
    configure_storage(s3_endpoint=endpoint)
    target = open_location(uri, fork_safe=True, max_attempts=3)
    CheckpointMirror(LocalLocation(local), target).sync()
    """
)


def test_a_reader_never_sees_a_checkpoint_without_its_manifest_even_if_the_copy_is_killed(tmp_path, s3):
    """The copy of step 2 is SIGKILLed mid-upload: readers listing the remote, during and after,
    see step 1 as the latest, whole; the next sync completes step 2."""
    local = tmp_path / "ckpt"
    save(local, 1)
    target = remote(s3, f"{uuid.uuid4().hex[:8]}/checkpoints")
    CheckpointMirror(LocalLocation(local), target).sync()
    save(local, 2)
    reader = CheckpointStore(target.uri)
    with FaultProxy(upstream=s3.endpoint) as proxy:
        proxy.add_rule("stall", method="PUT", path_contains="step_00000002/__0_1.distcp")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        copier = subprocess.Popen([sys.executable, "-c", _MIRROR_SCRIPT, str(local), target.uri, proxy.endpoint],
                                  env=env)  # fmt: skip
        try:
            assert proxy.stalled.wait(60), "the copy never reached the stalled upload"
            assert reader.latest() == target.child_uri("step_00000001")  # step 2 is in flight
            assert target.list_files("step_00000002")  # some of its objects are already there
            copier.send_signal(signal.SIGKILL)
            assert copier.wait(30) == -signal.SIGKILL
        finally:
            proxy.release()
            if copier.poll() is None:
                copier.kill()
    assert reader.latest() == target.child_uri("step_00000001")
    loaded = state(0, frozen_seed=5)
    assert reader.load(loaded, "latest").step == 1
    reader.verify("latest")
    assert [r.step for r in CheckpointMirror(LocalLocation(local), target).sync()] == [2]
    assert reader.latest() == target.child_uri("step_00000002")


def run_dir_with(tmp: Path, name: str, log: str) -> Path:
    run = tmp / name
    (run / "tensorboard").mkdir(parents=True)
    (run / "out.log").write_text(log)
    (run / "tensorboard" / f"events.out.tfevents.{name}").write_bytes(os.urandom(100))
    return run


def test_an_earlier_attempts_remote_logs_are_never_overwritten(tmp_path, s3):
    uri, client = f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:8]}", s3.client()
    first = run_dir_with(tmp_path, "first", "attempt 1: step 1\n")
    RemoteSync(first, uri).sync_once()
    # The same disk after a requeue: out.log was appended to, so the remote copy is replaced.
    with open(first / "out.log", "a") as f:
        f.write("attempt 2 on the same disk: step 2\n")
    again = RemoteSync(first, uri)
    assert "out.log" in again.sync_once().uploaded
    # A new machine (the local folder was lost): its out.log does not extend the remote one.
    fresh = run_dir_with(tmp_path, "fresh", "attempt 3 on a new machine: step 9\n")
    third = RemoteSync(fresh, uri)
    third.sync_once()
    with open(fresh / "out.log", "a") as f:
        f.write("step 10\n")
    time.sleep(0.01)
    os.utime(fresh / "out.log")
    third.sync_once()
    key = uri.removeprefix(f"s3://{BUCKET}/")
    listing = {
        o["Key"][len(key) + 1 :] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=key)["Contents"]
    }
    attempt_log = f"out.attempt-{third.attempt}.log"
    assert attempt_log in listing
    body = client.get_object(Bucket=BUCKET, Key=f"{key}/out.log")["Body"].read()
    assert body == b"attempt 1: step 1\nattempt 2 on the same disk: step 2\n"  # nothing lost
    newest = client.get_object(Bucket=BUCKET, Key=f"{key}/{attempt_log}")["Body"].read()
    assert newest == b"attempt 3 on a new machine: step 9\nstep 10\n"


def test_a_wrong_bucket_fails_the_check_in_seconds_with_one_clear_line(tmp_path, s3):
    sync = RemoteSync(tmp_path, "s3://no-such-bucket-here/runs/x")
    started = time.monotonic()
    with pytest.raises(Exception, match="no-such-bucket-here.*NoSuchBucket") as info:
        sync.check()
    assert time.monotonic() - started < 30 and "\n" not in str(info.value)


def test_a_sync_that_keeps_failing_reports_what_was_not_backed_up(tmp_path, s3):
    save(tmp_path / "run" / "checkpoints", 1)
    (tmp_path / "run" / "out.log").write_text("hello\n")
    with FaultProxy(upstream=s3.endpoint) as proxy, storage_configured(s3_endpoint=proxy.endpoint):
        sync = RemoteSync(tmp_path / "run", f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:8]}",
                          checkpoints=LocalLocation(tmp_path / "run" / "checkpoints"))  # fmt: skip
        proxy.add_rule("slowdown", method="PUT", path_contains="step_00000001/", times=-1)
        report = sync.stop(final_sync=True, attempts=2, backoff_s=0.1)
    assert not report.ok and sync.upload_counts == {"out.log": 1}
    assert report.summary().startswith("checkpoint step_00000001 was not backed up: ")
    assert "SlowDown" in report.summary() and "\n" not in report.summary()


def test_a_remote_checkpoint_of_the_same_step_with_other_bytes_is_replaced_whole(tmp_path, s3):
    """A run that resumed from an older checkpoint saves steps the remote already holds."""
    target = remote(s3, f"{uuid.uuid4().hex[:8]}/checkpoints")
    save(tmp_path / "a", 1)
    CheckpointMirror(LocalLocation(tmp_path / "a"), target).sync()
    other = CheckpointStore(str(tmp_path / "b"), io_threads=2)
    other.save(state(1, frozen_seed=9), step=1)
    assert [r.step for r in CheckpointMirror(other.location, target).sync()] == [1]
    reader = CheckpointStore(target.uri)
    reader.verify("latest")
    loaded = state(0, frozen_seed=5)
    reader.load(loaded, "latest")
    assert torch.equal(loaded["frozen"], state(1, frozen_seed=9)["frozen"])
