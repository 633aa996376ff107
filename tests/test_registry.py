"""Published checkpoints: immutable names, content-addressed objects, verify, leases, sources.

A real bigclip checkpoint (the tiny model's weights under `model.`, a train entry) is written
once through CheckpointStore; it is published from a folder, archives, HTTP (a local server)
and S3 (the loopback server), read back by name, damaged on purpose, leased and removed.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bigclip.checkpoint import CheckpointStore
from bigclip.cli import main as cli
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.errors import ConfigError, StorageError
from bigclip.models.factory import create_model
from bigclip.registry.leases import HeldLease
from bigclip.registry.registry import Registry
from bigclip.storage import s3_sink
from bigclip.storage.locations import LocalLocation
from bigclip.storage.ranged_reads import BlobFolder
from bigclip.weights.consolidate import consolidate
from bigclip.weights.dcp_chunks import locate_payload
from bigclip.weights.dcp_reader import DcpReader


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return create_model("tiny", device="cpu", seed=3).state_dict()


@pytest.fixture(scope="module")
def checkpoint(module_tmp, weights) -> Path:
    """A committed bigclip checkpoint: ROOT/step_00000005."""
    root = module_tmp("run") / "checkpoints"
    store = CheckpointStore(str(root))
    store.save({"model": weights, "train": {"step": 5}}, step=5, meta={"model": "tiny", "engine": "fsdp"})
    store.close()
    return root / "step_00000005"


@pytest.fixture(scope="module")
def s3() -> Iterator[LoopbackS3]:
    with LoopbackS3() as server:
        server.create_bucket("bigclip-registry")
        yield server


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder served over HTTP on 127.0.0.1 (nothing leaves the machine)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def assert_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    state = load_file(path)
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], v) for k, v in weights.items())


def test_publish_is_immutable_and_loads_by_name(checkpoint, weights, tmp_path, capsys):
    registry = Registry(str(tmp_path / "registry"))
    published = registry.publish(str(checkpoint.parent), "tiny-v1")  # a run root: its newest commit
    assert (published.kind, published.model, published.step) == ("dcp", "tiny", 5)
    assert "manifest.json" in published.objects and published.entry == ".metadata"
    with pytest.raises(StorageError, match="already published .* new name"):
        registry.publish(str(checkpoint), "tiny-v1")
    with pytest.raises(ConfigError, match="invalid checkpoint name"):
        registry.publish(str(checkpoint), "../escape")
    out = tmp_path / "tiny.safetensors"
    assert (
        cli(["consolidate", "registry:tiny-v1", str(out), "--registry", registry.uri, "--no-progress"]) == 0
    )
    assert_weights(out, weights)
    assert cli(["checkpoints", "list", "--registry", registry.uri]) == 0
    listing = capsys.readouterr().out
    assert "tiny-v1" in listing and "dcp" in listing and "MB" in listing  # storage used is shown
    assert cli(["checkpoints", "verify", "tiny-v1", "--registry", registry.uri, "--no-progress"]) == 0


def test_damaged_objects_fail_verify_and_consolidation_with_the_object_named(checkpoint, tmp_path, capsys):
    registry = Registry(str(tmp_path / "registry"))
    published = registry.publish(str(checkpoint), "tiny-v1")
    name, record = max(published.objects.items(), key=lambda item: item[1].size)
    key = f"blobs/{record.sha256[:2]}/{record.sha256}"
    stored = tmp_path / "registry" / key
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 1
    stored.write_bytes(bytes(data))
    assert cli(["checkpoints", "verify", "tiny-v1", "--registry", registry.uri, "--no-progress"]) == 2
    assert f"{name} ({key})" in capsys.readouterr().err
    with pytest.raises(StorageError, match=name):
        consolidate("registry:tiny-v1", str(tmp_path / "out.safetensors"), registry=registry.uri)
    stored.write_bytes(bytes(data[:-10]))
    with pytest.raises(StorageError, match=f"{name} .*: {record.size - 10} bytes, manifest says"):
        consolidate("registry:tiny-v1", str(tmp_path / "out.safetensors"), registry=registry.uri)
    assert not (tmp_path / "out.safetensors").exists()


def test_sources_folder_archives_http_and_consolidated_files(checkpoint, weights, tmp_path, http_root):
    served, url = http_root
    registry = Registry(str(tmp_path / "registry"))
    with tarfile.open(served / "ckpt.tar.gz", "w:gz") as tar:
        tar.add(checkpoint, arcname="step_00000005")
    with zipfile.ZipFile(served / "ckpt.zip", "w") as archive:
        for path in checkpoint.iterdir():
            archive.write(path, f"step_00000005/{path.name}")
    for name, src in [("from-tar", f"{url}/ckpt.tar.gz"), ("from-zip", str(served / "ckpt.zip"))]:
        published = registry.publish(src, name)
        assert (published.kind, published.entry, published.model, published.step) == (
            "dcp", "step_00000005/.metadata", "tiny", 5,
        )  # fmt: skip
        consolidate(f"registry:{name}", str(tmp_path / f"{name}.safetensors"), registry=registry.uri)
        assert_weights(tmp_path / f"{name}.safetensors", weights)
    consolidate(str(checkpoint), str(served / "tiny.safetensors"))
    published = registry.publish(str(served / "tiny.safetensors"), "consolidated")  # + its manifest
    assert sorted(published.objects) == ["tiny.manifest.json", "tiny.safetensors"]
    assert (published.kind, published.model, published.step) == ("safetensors", "tiny", 5)
    plain = registry.publish(f"{url}/tiny.safetensors", "over-http", model="tiny")
    assert list(plain.objects) == ["tiny.safetensors"] and plain.model == "tiny"
    folder = registry.publish(str(served), "a-folder")
    assert {"ckpt.tar.gz", "ckpt.zip", "tiny.safetensors"} <= set(folder.objects)
    shutil.copy(served / "ckpt.zip", served / "bad.zip")
    with zipfile.ZipFile(served / "bad.zip", "a") as archive:
        archive.writestr("../outside", b"x")
    with pytest.raises(StorageError, match="refusing entry '../outside'"):
        registry.publish(str(served / "bad.zip"), "bad")
    assert not registry.is_published("bad")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rm_refuses_while_leased_and_breaks_only_stale_leases(checkpoint, tmp_path, capsys):
    registry = Registry(str(tmp_path / "registry"))
    registry.publish(str(checkpoint), "tiny-v1")
    lease = registry.acquire_lease("tiny-v1", owner="run-a")
    assert cli(["checkpoints", "show", "tiny-v1", "--registry", registry.uri]) == 0
    shown = capsys.readouterr().out
    assert "leases    1" in shown and "(live) owner 'run-a'" in shown and "__0_0.distcp" in shown
    args = ["checkpoints", "rm", "tiny-v1", "--registry", registry.uri]
    assert cli(args + ["--break-stale-leases"]) == 2  # a live lease is never broken
    assert "in use (1 lease(s)); wait for the runs to end" in capsys.readouterr().err
    lease.release()
    crashed = HeldLease(registry.location, "tiny-v1", owner="run-b")  # a run that died
    crashed.lease = crashed.lease.__class__(**{**vars(crashed.lease), "pid": dead_pid()})
    crashed.write()
    assert cli(args) == 2
    assert (
        "stale leases (from runs that died) can be removed with --break-stale-leases"
        in capsys.readouterr().err
    )
    assert registry.is_published("tiny-v1")
    assert cli(args + ["--break-stale-leases"]) == 0
    assert not registry.is_published("tiny-v1") and registry.names() == []
    with pytest.raises(StorageError, match="no checkpoint 'tiny-v1'"):
        registry.acquire_lease("tiny-v1", owner="late")


def test_lease_of_a_silent_run_goes_stale_after_its_ttl(checkpoint, tmp_path):
    registry = Registry(str(tmp_path / "registry"))
    registry.publish(str(checkpoint), "tiny-v1")
    silent = HeldLease(registry.location, "tiny-v1", owner="elsewhere", ttl_s=1.0)
    silent.lease = silent.lease.__class__(**{**vars(silent.lease), "host": "another-host"})
    silent.write()  # never renewed: its process is gone, on a host we cannot check
    with pytest.raises(StorageError, match="in use"):
        registry.remove("tiny-v1", break_stale_leases=True)
    time.sleep(1.1)
    assert registry.remove("tiny-v1", break_stale_leases=True) > 0


def largest_payload(folder: Path) -> tuple[str, int, int]:
    """(file, first byte, size) of the payload of the checkpoint's largest model tensor."""
    reader = DcpReader(BlobFolder(LocalLocation(folder)))
    info = max(reader.tensors("model."), key=lambda i: i.nbytes)
    chunk = reader._chunks[info.name][0]
    payload = locate_payload(reader.blobs, chunk, info.name, info.dtype)
    return chunk.file, payload.start, payload.nbytes


def test_s3_registry_round_trip_and_interrupted_upload(s3, checkpoint, weights, tmp_path, monkeypatch):
    """Publish to S3 from a local checkpoint and from an S3 prefix copied whole; consolidate by name
    into S3. A consolidation that fails after uploading parts leaves no object and no open upload."""
    client = s3.client()
    for path in checkpoint.iterdir():
        client.upload_file(str(path), "bigclip-registry", f"incoming/ckpt/{path.name}")
    registry = Registry("s3://bigclip-registry/registry")
    assert registry.publish(str(checkpoint), "tiny-v1").kind == "dcp"
    copied = registry.publish("s3://bigclip-registry/incoming/ckpt/", "tiny-copy")
    assert copied.objects == registry.get("tiny-v1").objects  # same bytes, same addresses
    registry.verify("tiny-copy")
    consolidate("registry:tiny-copy", "s3://bigclip-registry/out/tiny.safetensors", registry=registry.uri)
    client.download_file("bigclip-registry", "out/tiny.safetensors", str(tmp_path / "tiny.safetensors"))
    assert_weights(tmp_path / "tiny.safetensors", weights)
    assert registry.remove("tiny-copy") == 0  # every blob is tiny-v1's too, so none is freed
    assert not registry.is_published("tiny-copy")
    registry.verify("tiny-v1")

    damaged = tmp_path / "damaged" / "step_00000005"
    shutil.copytree(checkpoint, damaged)
    monkeypatch.setattr(s3_sink, "PART_BYTES", 5 << 20)  # S3's minimum part size
    file, start, size = largest_payload(damaged)
    assert size > 2 * s3_sink.PART_BYTES
    data = bytearray((damaged / file).read_bytes())
    data[start + size - 100] ^= 1  # seen at the payload's end (its CRC), after 2 parts went up
    (damaged / file).write_bytes(bytes(data))
    with pytest.raises(StorageError, match=f"{file} \\(byte \\d+\\) is damaged: .*CRC-32"):
        consolidate(str(damaged), "s3://bigclip-registry/out/damaged.safetensors", piece_bytes=1 << 20)
    assert "Contents" not in client.list_objects_v2(Bucket="bigclip-registry", Prefix="out/damaged")
    assert not client.list_multipart_uploads(Bucket="bigclip-registry").get("Uploads")


def test_damaged_source_stops_publish_and_a_rerun_completes(checkpoint, tmp_path, capsys):
    """A source object whose bytes differ from its manifest is caught while copied: nothing is
    published; once the source is fixed, publishing again completes, keeping what was stored."""
    source = tmp_path / "src" / "step_00000005"
    shutil.copytree(checkpoint, source)
    last = sorted(p for p in source.iterdir() if p.name.endswith(".distcp"))[-1]
    good = last.read_bytes()
    last.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    registry = Registry(str(tmp_path / "registry"))
    with pytest.raises(StorageError, match=f"{last.name}: the source object is damaged"):
        registry.publish(str(source), "tiny-v1")
    assert not registry.is_published("tiny-v1")
    assert cli(["checkpoints", "list", "--registry", registry.uri]) == 0
    assert "incomplete" in capsys.readouterr().out
    last.write_bytes(good)
    published = registry.publish(str(source), "tiny-v1")
    registry.verify("tiny-v1")
    assert published.objects[last.name].size == len(good)
