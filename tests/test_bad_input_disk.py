"""Disks that fill and writes that are killed: a save, a consolidate or a publish onto a full disk
ends in one line saying the disk is full (ENOSPC), where, and that nothing was committed, with no
writer thread's traceback and no output left without its manifest; a consolidate or publish killed
mid-write leaves temporary files that the next one to the same output removes, saying so.

The full disks are real: a tmpfs of a few MiB mounted for the row (root only; elsewhere the rows
are skipped with the reason, and fail under CI, which runs as root). The checkpoint consolidated
and published is written by the real store (8 MiB of weights); the save is a real `bigclip train`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.bad_input import ROOT, Case, bigclip, check

from bigclip.checkpoint import CheckpointStore
from bigclip.registry.registry import Registry

WORK_S = 120.0  # the save row trains a step first: torch, the model, the loader
READ_S = 30.0  # consolidate and publish import torch and read the checkpoint before the disk fills
PAGE = 4096  # tmpfs counts whole pages
STALE = 120  # seconds a killed writer's file is made older than (local_location.STALE_AFTER_S is 60)


@pytest.fixture(scope="module")
def checkpoint(module_tmp) -> Path:
    """A committed checkpoint holding 8 MiB of model weights."""
    root = module_tmp("disk") / "checkpoints"
    store = CheckpointStore(str(root))
    store.save({"model": {"visual.proj": torch.randn(1024, 2048)}}, step=1, meta={"model": "tiny"})
    store.close()
    return root / "step_00000001"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """mount(bytes) -> the folder of a tmpfs that holds that many bytes (whole pages)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            reason = f"cannot mount a small tmpfs here ({done.stderr.strip() or 'not root'})"
            pytest.fail(f"CI must run the full-disk rows: {reason}") if os.environ.get("CI") else pytest.skip(
                reason
            )
        mounted.append(folder)
        return folder

    if os.geteuid() != 0:
        reason = "mounting a small tmpfs needs root"
        pytest.fail(f"CI must run the full-disk rows: {reason}") if os.environ.get("CI") else pytest.skip(
            reason
        )
    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def files_under(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


def test_a_save_onto_a_full_disk_is_one_line(demo_data, small_disk, tmp_path: Path) -> None:
    """DCP's writer threads fail one after the other; the run says once that the disk is full."""
    disk = small_disk(8 << 20)  # the tiny model's weights and Adam moments need ~40 MiB
    case = Case("save onto a full disk", bigclip(
        "train", "--model", "tiny", "--train-data", demo_data.train_pattern, "--precision", "fp32", "--batch-size",
        "8", "--workers", "0", "--max-steps", "1", "--logs", "logs", "--name", "full", "--checkpoint-dir",
        str(disk / "ckpt")), (f"{disk / 'ckpt'}/step_00000001: the disk is full (ENOSPC", "this checkpoint is not committed"),
        max_s=WORK_S, leaves=("logs/full", f"{disk.name}/ckpt"))  # fmt: skip
    check(case, cwd=tmp_path)
    assert not list((disk / "ckpt").rglob("manifest.json"))  # what was written stays uncommitted, never read


def test_consolidate_onto_a_full_disk_leaves_nothing(checkpoint, small_disk, tmp_path: Path) -> None:
    disk = small_disk(4 << 20)
    case = Case("consolidate onto a full disk", bigclip("consolidate", str(checkpoint), str(disk / "w.safetensors"),
                "--no-progress"), (f"{disk}/w.safetensors: the disk is full (ENOSPC", "nothing was committed"),
                max_s=READ_S)  # fmt: skip
    check(case, cwd=tmp_path, protect=[checkpoint])
    assert files_under(disk) == []  # no output, no manifest, no temporary file


def test_an_output_whose_manifest_does_not_fit_is_not_left(checkpoint, small_disk, tmp_path: Path) -> None:
    """A disk with room for the weights file and not for its manifest: before, the file stayed under
    its name with no manifest to check it against."""
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, *bigclip("consolidate", str(checkpoint), str(reference / "w.safetensors"),
                    "--no-progress")], env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, capture_output=True)  # fmt: skip
    size = (reference / "w.safetensors").stat().st_size
    disk = small_disk(math.ceil(size / PAGE) * PAGE)
    case = Case("consolidate: the manifest does not fit", bigclip("consolidate", str(checkpoint),
                str(disk / "w.safetensors"), "--no-progress"), ("the disk is full (ENOSPC",), max_s=READ_S)  # fmt: skip
    check(case, cwd=tmp_path, protect=[checkpoint])
    assert files_under(disk) == []


def test_publish_onto_a_full_disk_is_one_line(checkpoint, small_disk, tmp_path: Path) -> None:
    """The blobs stored before the disk filled stay (a publish again reuses them; `checkpoints gc`
    sweeps them), and `checkpoints list` shows the name as incomplete; no temporary file is left."""
    disk = small_disk(4 << 20)
    case = Case("publish onto a full disk", bigclip("publish", str(checkpoint), "tiny-v1", "--registry",
                str(disk / "reg"), "--no-progress"), ("the disk is full (ENOSPC", "nothing was published"),
                max_s=READ_S, leaves=(f"{disk.name}/reg",))  # fmt: skip
    check(case, cwd=tmp_path, protect=[checkpoint])
    assert not [n for n in files_under(disk) if n.startswith(".")]
    assert not Registry(str(disk / "reg")).is_published("tiny-v1")


KILLED_WRITER = """
import os, sys
from bigclip.storage.locations import LocalLocation
sink = LocalLocation(sys.argv[1]).open_sink(sys.argv[2], overwrite=True)
sink.write(b"half of a file" * 1000)
os.kill(os.getpid(), 9)
"""


def killed_write(folder: Path, name: str) -> Path:
    """The temporary file of a writer killed mid-write (as `kill -9` leaves it), a few minutes old."""
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(folder), name],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)  # fmt: skip
    assert done.returncode == -9, done.stderr
    (left,) = (folder / name).parent.glob(f".{Path(name).name}.partial-*")
    os.utime(left, (time.time() - STALE, time.time() - STALE))
    return left


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *bigclip(*args)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)  # fmt: skip


def test_the_next_consolidate_removes_what_a_killed_one_left(checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    left = killed_write(out, "w.safetensors")
    done = run("consolidate", str(checkpoint), str(out / "w.safetensors"), "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"removed 1 temporary file(s) an interrupted write to {out} left: {left.name}" in done.stderr
    assert files_under(out) == ["w.manifest.json", "w.safetensors"]


def test_the_next_publish_removes_what_a_killed_one_left(checkpoint, tmp_path: Path) -> None:
    registry = tmp_path / "reg"
    (registry / "blobs" / "ab").mkdir(parents=True)
    left = killed_write(registry, "blobs/ab/ab" + "0" * 62)
    done = run(
        "publish", str(checkpoint), "tiny-v1", "--registry", str(registry), "--no-progress", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        f"removed 1 temporary file(s) an interrupted publish to {registry} left: blobs/ab/{left.name}"
        in done.stderr
    )
    assert not left.exists()
