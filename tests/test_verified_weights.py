"""Weights with a record are checked in the pass that reads them: the hashing reader, a checked
safetensors file (registry blob or consolidated file with its manifest) and a registry `.pt`.

Real files on disk, real registries; damage is a flipped or a missing byte.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bigclip.checkpoint.integrity import CheckpointDamaged, StreamDigest, read_checked
from bigclip.registry.registry import Registry
from bigclip.storage.records import ObjectRecord
from bigclip.weights.safetensors_writer import plan_output, write_safetensors
from bigclip.weights.sources import open_weights

STATE = {f"layer{i}.weight": torch.arange(3000 + 7 * i, dtype=torch.float32) * (i + 1) for i in range(6)}


def record_of(data: bytes) -> ObjectRecord:
    return ObjectRecord(len(data), hashlib.sha256(data).hexdigest())


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_the_hashing_reader_passes_intact_bytes_through_and_names_damage():
    data = bytes(range(256)) * 1000
    sink = io.BytesIO()
    read_checked(io.BytesIO(data), StreamDigest(record_of(data), where="x.bin"), sink=sink, chunk_bytes=4096)
    assert sink.getvalue() == data
    damaged = bytearray(data)
    damaged[12345] ^= 1
    with pytest.raises(
        CheckpointDamaged, match=r"x.bin is damaged: its 256000 bytes .* recorded 256000 .*; do"
    ):
        read_checked(io.BytesIO(bytes(damaged)), StreamDigest(record_of(data), where="x.bin", advice="do"))
    with pytest.raises(CheckpointDamaged, match="its 255999 bytes"):
        read_checked(io.BytesIO(data[:-1]), StreamDigest(record_of(data), where="x.bin"))


@pytest.fixture
def consolidated(tmp_path: Path) -> Path:
    """A file written as `bigclip consolidate` writes it: with its checksum manifest beside it."""
    infos = open_weights(str(_plain(tmp_path))).reader.tensors()
    plan = plan_output(str(tmp_path / "out" / "m.safetensors"), infos)
    pieces = ((info, STATE[info.name]) for info in infos)
    write_safetensors(plan, pieces, metadata={}, manifest={})
    return tmp_path / "out" / "m.safetensors"


def _plain(tmp_path: Path) -> Path:
    save_file(STATE, tmp_path / "plain.safetensors")
    return tmp_path / "plain.safetensors"


def test_a_checked_file_reads_every_tensor_intact_in_file_order(consolidated):
    reader = open_weights(str(consolidated)).reader
    assert reader.checked  # the manifest beside it was found
    names = [info.name for info in reader.tensors()]
    assert dict(reader.read_each(names)).keys() == set(names)
    assert all(torch.equal(t, STATE[n]) for n, t in reader.read_each(names))
    assert torch.equal(reader.read(names[2]), STATE[names[2]])
    with pytest.raises(ValueError, match="file order"):
        list(reader.read_each(names[::-1]))


def test_damage_stops_the_read_before_the_last_tensor_is_handed_out(consolidated):
    flip(consolidated, consolidated.stat().st_size - 4)  # the last tensor's last element
    reader = open_weights(str(consolidated)).reader
    names = [info.name for info in reader.tensors()]
    handed_out = []
    with pytest.raises(
        CheckpointDamaged, match=f"{consolidated} is damaged: .* SHA-256 .*bigclip consolidate"
    ):
        for name, _ in reader.read_each(names):
            handed_out.append(name)
    assert handed_out == names[:-1]


def test_bytes_of_tensors_not_asked_for_are_checked_too(consolidated):
    flip(consolidated, consolidated.stat().st_size - 4)  # in the last tensor, which is not read
    reader = open_weights(str(consolidated)).reader
    with pytest.raises(CheckpointDamaged):
        list(reader.stream(reader.tensors()[:2], piece_bytes=1024))


def test_a_grown_or_truncated_consolidated_file_fails_before_any_read(consolidated):
    consolidated.write_bytes(consolidated.read_bytes() + b"\0")
    with pytest.raises(CheckpointDamaged, match="holds .* bytes, its writer recorded"):
        open_weights(str(consolidated))


def test_a_file_without_a_manifest_has_nothing_to_check_against(tmp_path):
    reader = open_weights(str(_plain(tmp_path))).reader
    assert not reader.checked
    assert torch.equal(reader.read("layer1.weight"), STATE["layer1.weight"])


def test_a_registry_pt_blob_is_hashed_before_torch_maps_it(tmp_path):
    torch.save({"state_dict": STATE}, tmp_path / "m.pt")
    registry = Registry(str(tmp_path / "reg"))
    sha = registry.publish(str(tmp_path / "m.pt"), "pt").objects["m.pt"].sha256
    source = open_weights("registry:pt", registry=registry.uri)
    assert torch.equal(source.reader.read("layer3.weight"), STATE["layer3.weight"])
    blob = tmp_path / "reg" / "blobs" / sha[:2] / sha
    blob.chmod(0o644)
    flip(blob, blob.stat().st_size // 2)
    with pytest.raises(
        CheckpointDamaged, match=r"registry:pt m.pt \(blob .*\) is damaged.*checkpoints verify pt"
    ):
        open_weights("registry:pt", registry=registry.uri)
