"""The registry stores each file's bytes once, shared by every name; more sources (plain S3
prefixes, git at a ref, fsspec filesystems); publishing and removal running at the same time."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch

from bigclip.checkpoint import CheckpointStore
from bigclip.cli import main as cli
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.errors import StorageError
from bigclip.registry import blobs as blob_module
from bigclip.registry.registry import Registry
from bigclip.storage.progress import human_bytes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def checkpoint(module_tmp) -> Path:
    root = module_tmp("run") / "checkpoints"
    g = torch.Generator().manual_seed(0)
    weights = {f"model.layer{i}": torch.randn(256, 256, generator=g) for i in range(4)}
    store = CheckpointStore(str(root))
    store.save({**weights, "train": {"step": 7}}, step=7, meta={"model": "tiny"})
    store.close()
    return root / "step_00000007"


def blob_files(registry_root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (registry_root / "blobs").rglob("*") if p.is_file()}


def test_identical_bytes_are_stored_once_and_rm_keeps_what_another_name_holds(checkpoint, tmp_path, capsys):
    root = tmp_path / "registry"
    first = Registry(str(root)).publish(str(checkpoint), "ckpt-a")
    assert blob_files(root) == first.blobs()  # every distinct file once
    second_registry = Registry(str(root))
    second = second_registry.publish(str(checkpoint), "ckpt-b")
    assert second_registry.blobs.uploaded_bytes == 0  # the same bytes under a second name: nothing sent
    assert second.objects == first.objects and blob_files(root) == first.blobs()
    assert cli(["checkpoints", "list", "--registry", str(root)]) == 0
    listing = capsys.readouterr().out
    logical, stored = human_bytes(first.total_bytes * 2), human_bytes(first.stored_bytes)
    assert f"total: {logical} logical, {stored} stored" in listing
    assert cli(["checkpoints", "rm", "ckpt-a", "--registry", str(root)]) == 0
    assert "(0 B freed; blobs other names hold are kept)" in capsys.readouterr().out
    Registry(str(root)).verify("ckpt-b")  # every byte still there
    assert Registry(str(root)).remove("ckpt-b") == first.stored_bytes
    assert blob_files(root) == {}


def test_a_plain_s3_prefix_is_published_whole(tmp_path):
    files = {
        "config.json": b'{"dim": 8}',
        "weights/part-0.bin": b"\x01" * 5000,
        "weights/part-1.bin": b"\x02" * 3,
    }
    with LoopbackS3() as s3:
        s3.create_bucket("registry-src")
        for key, data in files.items():
            s3.client().put_object(Bucket="registry-src", Key=f"gen/{key}", Body=data)
        registry = Registry(str(tmp_path / "registry"))
        published = registry.publish("s3://registry-src/gen/", "gen-v1")
    assert published.kind == "files" and sorted(published.objects) == sorted(files)
    for path, data in files.items():
        assert registry.blob_folder(published, root="").read_all(path) == data


def git(*args: str, cwd: Path) -> str:
    identity = ["-c", "user.name=bigclip-test", "-c", "user.email=test@localhost"]
    return subprocess.run(
        ["git", *identity, *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


def test_a_git_repository_at_a_tag_and_a_sub_folder(checkpoint, tmp_path):
    if shutil.which("git") is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("git sources need the git command-line tool")
    repo = tmp_path / "repo"
    shutil.copytree(checkpoint, repo / "ckpt")
    (repo / "README.md").write_text("v1\n")
    git("init", "-q", cwd=repo)
    git("add", ".", cwd=repo)
    git("commit", "-q", "-m", "v1", cwd=repo)
    git("tag", "v1.0", cwd=repo)
    tagged = git("rev-parse", "HEAD", cwd=repo).strip()
    (repo / "README.md").write_text("v2, after the tag\n")
    git("commit", "-q", "-am", "v2", cwd=repo)
    registry = Registry(str(tmp_path / "registry"))
    clones_before = set(Path(tempfile.gettempdir()).glob("bigclip-git-*"))
    whole = registry.publish(f"git+file://{repo}@v1.0", "from-git")
    assert whole.source == f"git+file://{repo}@{tagged}"  # the commit, not the movable tag
    assert registry.blob_folder(whole, root="").read_all("README.md") == b"v1\n"
    assert ".git" not in {p.split("/")[0] for p in whole.objects}
    sub = registry.publish(f"git+file://{repo}@v1.0#ckpt", "from-git-ckpt")
    assert (sub.kind, sub.step, sub.model) == ("dcp", 7, "tiny")  # a bigclip checkpoint, recognised
    with pytest.raises(StorageError, match="has no branch, tag or commit 'no-such-tag'"):
        registry.publish(f"git+file://{repo}@no-such-tag", "nope")
    assert set(Path(tempfile.gettempdir()).glob("bigclip-git-*")) == clones_before  # clones deleted


def test_fsspec_sources_and_a_missing_filesystem_package(checkpoint, tmp_path):
    fs = fsspec.filesystem("memory")
    for path in checkpoint.iterdir():
        fs.pipe_file(f"/models/step_00000007/{path.name}", path.read_bytes())
    fs.pipe_file("/models/notes/readme.txt", b"hello")
    registry = Registry(str(tmp_path / "registry"))
    published = registry.publish("memory://models/step_00000007/", "from-memory")
    assert (published.kind, published.step) == ("dcp", 7)
    assert published.objects == Registry(str(tmp_path / "r2")).publish(str(checkpoint), "local").objects
    single = registry.publish("memory://models/notes/readme.txt", "one-file")
    assert list(single.objects) == ["readme.txt"]
    registry.verify("one-file")
    if not _importable("gcsfs"):  # not a dependency: the error names the package to install
        with pytest.raises(StorageError, match="install that package .*gs:// gcsfs"):
            registry.publish("gs://bucket/weights/", "from-gcs")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_rm_during_a_publish_that_relies_on_shared_blobs_keeps_them(checkpoint, tmp_path, monkeypatch):
    """B is published while A, holding the same blobs, is removed: B's publish found the blobs
    stored and sent nothing, so the sweep after `rm A` must not delete them."""
    root = tmp_path / "registry"
    Registry(str(root)).publish(str(checkpoint), "ckpt-a")
    reached, go_on = threading.Event(), threading.Event()
    original = blob_module.BlobStore.put_local

    def slow_put(self, path, expected=None):  # noqa: ANN001
        record = original(self, path, expected)  # the blob exists: nothing is written
        reached.set()
        assert go_on.wait(60)
        return record

    monkeypatch.setattr(blob_module.BlobStore, "put_local", slow_put)
    errors: list[BaseException] = []
    publisher = threading.Thread(target=_publish, args=(root, checkpoint, "ckpt-b", errors))
    publisher.start()
    assert reached.wait(60)
    assert Registry(str(root)).remove("ckpt-a") == 0  # the sweep sees the publish in flight
    go_on.set()
    publisher.join(60)
    assert not errors
    Registry(str(root)).verify("ckpt-b")


def test_a_publish_waits_while_a_sweep_runs(checkpoint, tmp_path):
    root = tmp_path / "registry"
    registry = Registry(str(root))
    assert registry.blobs._lock()  # a sweep in progress (this process holds gc.lock)
    errors: list[BaseException] = []
    publisher = threading.Thread(target=_publish, args=(root, checkpoint, "ckpt", errors))
    publisher.start()
    time.sleep(1.5)
    assert not (root / "blobs").exists()  # it has not looked at (or written) any blob yet
    registry.location.delete(blob_module.GC_LOCK)
    publisher.join(60)
    assert not errors and registry.is_published("ckpt")


def test_two_publishes_of_the_same_bytes_at_once(checkpoint, tmp_path):
    root = tmp_path / "registry"
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_publish, args=(root, checkpoint, f"twin-{i}", errors)) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    registry = Registry(str(root))
    for name in ("twin-0", "twin-1"):
        registry.verify(name)
    assert blob_files(root) == registry.get("twin-0").blobs()


def _publish(root: Path, src: Path, name: str, errors: list[BaseException]) -> None:
    try:
        Registry(str(root)).publish(str(src), name)
    except BaseException as e:  # reported by the test
        errors.append(e)
