"""Bad `bigclip make-demo-data` and `bigclip demo` options: one line each, before anything is
written; demo data already in the folder stays as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.bad_input import ROOT, Case, bigclip, check

from bigclip.demo.shapes_data import SIZES_FILE, write_demo_data


def make(name: str, *args: str, says: tuple[str, ...]) -> Case:
    return Case(name, bigclip("make-demo-data", *args), says)


CASES = [
    make("out-missing", says=("the following arguments are required: out", "bigclip make-demo-data --help")),
    make("folder-holds-demo-data", "made", says=("made holds demo data already", "give a new folder")),
    make("out-under-a-file", "notes.txt/demo", says=("notes.txt is a file, not a folder",)),
    make("val-samples-above-captions", "new", "--val-samples", "721", says=("--val-samples must be 0..720", "721")),
    make("val-samples-negative", "new", "--val-samples", "-1", says=("--val-samples must be 0..720",)),
    make("shards-zero", "new", "--shards", "0", says=("--shards must be between 1 and --samples",)),
    make("shards-above-samples", "new", "--samples", "4", "--shards", "5", says=("--samples (4), got 5",)),
    make("samples-zero", "new", "--samples", "0", says=("--shards must be between 1 and --samples (0)",)),
    make("classify-negative", "new", "--classify-samples", "-3", says=("--classify-samples", "got -3")),
    make("image-size-zero", "new", "--image-size", "0", says=("--image-size must be 8..1024", "got 0")),
    make("image-size-huge", "new", "--image-size", "100000", says=("--image-size must be 8..1024",)),
    make("samples-not-a-number", "new", "--samples", "lots", says=("--samples", "invalid int value: 'lots'")),
    make("unknown-flag", "new", "--val-sampels", "3", says=("--val-sampels", "did you mean --val-samples?")),
    Case("demo-unknown-flag", bigclip("demo", "--bogus"), ("bigclip demo: error: unrecognized arguments: --bogus", "bigclip demo --help")),
]  # fmt: skip


@pytest.fixture(scope="module")
def home(module_tmp) -> Path:
    home = module_tmp("demo")
    write_demo_data(str(home / "made"), samples=8, shards=1, val_samples=2, classify_samples=0, image_size=16)
    (home / "notes.txt").write_text("not a folder\n")
    return home


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_demo_option(case: Case, home: Path) -> None:
    check(case, cwd=home, protect=[home])
    assert not (home / "new").exists()


def test_no_held_out_set_writes_none_and_suggests_none(tmp_path: Path) -> None:
    """--val-samples 0 used to write an empty val shard and suggest a --val-data that failed at the
    final evaluation; now it writes no val/ and suggests only --train-data."""
    done = subprocess.run([sys.executable, "-m", "bigclip", "make-demo-data", "out", "--samples", "8", "--shards",
                           "2", "--val-samples", "0", "--classify-samples", "0", "--image-size", "16"],
                          cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--val-data" not in done.stdout and "--train-data 'out/train/{00000..00001}.tar'" in done.stdout
    assert not (tmp_path / "out" / "val").exists() and (tmp_path / "out" / "train" / SIZES_FILE).exists()


def test_the_demo_writes_the_sizes_file_the_data_code_reads() -> None:
    from bigclip.data.shards import SIZES_FILE as read_by_data

    assert read_by_data == SIZES_FILE
