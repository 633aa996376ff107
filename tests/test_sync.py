"""Remote sync of the run directory: changed files only, retried on failure, final sync on stop."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
import uuid
from pathlib import Path

import pytest
from support.s3_fault_proxy import FaultProxy

from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.errors import ConfigError, StorageError
from bigclip.storage.settings import storage_configured
from bigclip.train.remote_sync import RemoteSync


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket("sync-tests")
        yield server


def make_run_dir(root: Path) -> Path:
    run = root / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "out.log").write_text("step 1 loss 3.2\n")
    (run / "params.txt").write_text("lr: 0.001\n")
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(os.urandom(3000))
    (run / "checkpoints" / "step_00000001" / "__0_0.distcp").write_bytes(b"big shard")
    return run


def touch_later(path: Path, text: str) -> None:
    """Append and move the mtime forward, as a log written a while later would."""
    with open(path, "a") as f:
        f.write(text)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def remote_files(s3, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    listing = client.list_objects_v2(Bucket="sync-tests", Prefix=prefix + "/").get("Contents", [])
    return {
        o["Key"][len(prefix) + 1 :]: client.get_object(Bucket="sync-tests", Key=o["Key"])["Body"].read()
        for o in listing
    }


def local_files(run: Path, *, exclude: str = "checkpoints") -> dict[str, bytes]:
    return {
        p.relative_to(run).as_posix(): p.read_bytes()
        for p in run.rglob("*")
        if p.is_file() and not p.relative_to(run).as_posix().startswith(exclude)
    }


def test_s3_sync_copies_changed_files_only_and_skips_checkpoints(tmp_path, s3):
    run, prefix = make_run_dir(tmp_path), f"runs/{uuid.uuid4().hex[:8]}"
    sync = RemoteSync(run, f"s3://sync-tests/{prefix}", protocol="s3")
    assert sorted(sync.sync_once().uploaded) == ["out.log", "params.txt", "tensorboard/events.out.tfevents.1"]
    touch_later(run / "out.log", "step 2 loss 3.1\n")
    (run / "tensorboard" / "events.out.tfevents.2").write_bytes(b"new events")
    assert sorted(sync.sync_once().uploaded) == ["out.log", "tensorboard/events.out.tfevents.2"]
    assert sync.sync_once().uploaded == []
    assert sync.upload_counts["params.txt"] == 1 and sync.upload_counts["out.log"] == 2
    assert remote_files(s3, prefix) == local_files(run)


def test_background_sync_runs_periodically_and_stop_waits_for_a_final_sync(tmp_path, s3):
    run, prefix = make_run_dir(tmp_path), f"runs/{uuid.uuid4().hex[:8]}"
    sync = RemoteSync(run, f"s3://sync-tests/{prefix}", every_s=0.05).start()
    deadline = time.monotonic() + 60
    while "out.log" not in sync.upload_counts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "out.log" in sync.upload_counts, "the background thread never synced"
    touch_later(run / "out.log", "final line\n")
    assert sync.stop(final_sync=True)
    assert remote_files(s3, prefix)["out.log"].endswith(b"final line\n")


def test_fsspec_protocol_syncs_to_a_file_url(tmp_path):
    run, remote = make_run_dir(tmp_path), tmp_path / "remote"
    sync = RemoteSync(run, remote.as_uri(), protocol="fsspec")
    sync.sync_once()
    touch_later(run / "params.txt", "wd: 0.1\n")
    assert sync.sync_once().uploaded == ["params.txt"]
    assert local_files(remote) == local_files(run)


def test_failures_are_logged_retried_and_never_raised(tmp_path, s3, caplog):
    run, prefix = make_run_dir(tmp_path), f"runs/{uuid.uuid4().hex[:8]}"
    with FaultProxy(upstream=s3.endpoint) as proxy, storage_configured(s3_endpoint=proxy.endpoint):
        sync = RemoteSync(run, f"s3://sync-tests/{prefix}")
        proxy.add_rule("slowdown", method="PUT", path_contains="out.log", times=-1)
        with caplog.at_level(logging.WARNING, logger="bigclip.train.remote_sync"):
            report = sync.sync_once()
        assert list(report.failed) == ["out.log"] and "out.log not copied" in caplog.text
        proxy.clear_rules()
        assert sync.stop(final_sync=True)  # the final sync picks up what failed before
    assert remote_files(s3, prefix) == local_files(run)


def test_unusable_protocol_fails_before_training(tmp_path):
    with pytest.raises(ConfigError, match="needs an s3:// URI"):
        RemoteSync(tmp_path, (tmp_path / "x").as_uri(), protocol="s3")
    with pytest.raises(ConfigError, match="must be one of"):
        RemoteSync(tmp_path, "s3://b/x", protocol="rsync")
    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(StorageError, match="fsspec cannot handle 's3://sync-tests/x'.*s3fs"):
            RemoteSync(tmp_path, "s3://sync-tests/x", protocol="fsspec")
