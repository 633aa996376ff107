"""Preflight (`CheckpointStore.check_access`) and `bigclip doctor`: fail fast, say what to fix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from bigclip.checkpoint import CheckpointStore
from bigclip.cli import main as bigclip_main
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import free_port
from bigclip.errors import StorageError
from bigclip.storage.access_checks import PROBE_PREFIX, check_access
from bigclip.storage.locations import LocalLocation
from bigclip.storage.settings import storage_configured


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket("doctor-ok")
        yield server


def test_doctor_passes_and_measures_throughput_on_a_healthy_bucket(s3, capsys):
    assert bigclip_main(["doctor", "s3://doctor-ok/runs", "--size-mb", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    checks = ["credentials", "list", "put", "get", "delete", "upload 4 MB", "download 4 MB", "cleanup"]
    for check in checks:
        assert any(line.startswith("PASS") and f" {check} " in line + " " for line in lines), check
    assert sum("MB/s" in line for line in lines) == 2
    assert lines[-1] == "all checks passed"
    left = s3.client().list_objects_v2(Bucket="doctor-ok", Prefix=f"runs/{PROBE_PREFIX}")
    assert left["KeyCount"] == 0


def test_doctor_checks_a_local_folder(tmp_path, capsys):
    assert bigclip_main(["doctor", str(tmp_path / "ckpt"), "--size-mb", "1"]) == 0
    assert "FAIL" not in capsys.readouterr().out
    assert not list((tmp_path / "ckpt").glob(f"{PROBE_PREFIX}*"))


def test_nodes_probing_one_shared_folder_at_once_do_not_trip_each_other(tmp_path):
    # Every node's first rank probes the same checkpoint folder at the same moment.
    location = LocalLocation(str(tmp_path / "shared"))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: check_access(location), range(200)))
    assert not list((tmp_path / "shared").glob(f"{PROBE_PREFIX}*"))


@pytest.mark.timeout(60)
def test_wrong_bucket_fails_preflight_in_seconds(s3, capsys):
    store = CheckpointStore("s3://no-such-bucket/runs")
    with pytest.raises(StorageError, match="list: the bucket does not exist: check the bucket name"):
        store.check_access()
    assert bigclip_main(["doctor", "s3://no-such-bucket/runs"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  list" in out and "1 check(s) failed" in out


@pytest.mark.timeout(60)
def test_missing_credentials_fail_preflight_in_seconds(s3, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = CheckpointStore("s3://doctor-ok/runs")
    with pytest.raises(StorageError, match="credentials: no AWS credentials found"):
        store.check_access()


@pytest.mark.timeout(60)
def test_unreachable_endpoint_fails_preflight_in_seconds():
    with storage_configured(s3_endpoint=f"http://127.0.0.1:{free_port()}"):  # nothing listens there
        store = CheckpointStore("s3://doctor-ok/runs")
    with pytest.raises(StorageError, match="cannot connect to the endpoint"):
        store.check_access()


def test_unwritable_local_location_fails_preflight(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match="a-file/ckpt is not usable: folder"):
        CheckpointStore(str(blocker / "ckpt")).check_access()


def test_not_a_location_is_refused():
    with pytest.raises(StorageError, match="no storage scheme 'gs' is registered.*a local folder, s3://"):
        CheckpointStore("gs://bucket/prefix")
