"""`make bench-gpu`'s bookkeeping, which has one 10-minute command per device call to spend:
a row that runs past its timeout, crashes, skips itself or lacks a package is recorded as such
(a crash is never an out-of-memory), and the suite goes on to the next row. Real subprocesses;
the rows' own GPU work is tested on a GPU (tests/test_gpu_*.py)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_suite import GPU_TEST_FILES, ROWS, Row, run_row  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize(
    ("code", "timeout_s", "status", "detail"),
    [
        ("print('row done')", 60, "ok", ""),
        ("print('SKIP: needs a CUDA GPU')", 60, "skipped", "needs a CUDA GPU"),
        ("raise RuntimeError('CUDA error: an illegal memory access')", 60, "failed", "illegal memory access"),
        ("print('started', flush=True); import time; time.sleep(30)", 2, "timeout", "started\n"),
    ],
    ids=["ok", "skips-itself", "crash", "timeout"],
)
def test_each_outcome_is_recorded_as_what_it_was(code, timeout_s, status, detail):
    result = run_row(Row("row", ("-c", code), timeout_s, quick_argv=()), quick=False, env=ENV)
    assert result["status"] == status and detail in result["detail"], result  # a crash is "failed", not OOM


def test_a_row_whose_package_is_missing_is_skipped_naming_it():
    row = Row("row", ("-c", "raise SystemExit(3)"), 60, needs=("no_such_package_xyz",))
    result = run_row(row, quick=False, env=ENV)
    assert result["status"] == "skipped"
    assert result["detail"] == "needs no_such_package_xyz (not installed)"


def test_quick_adds_the_rows_quick_arguments():
    row = Row("row", ("-c", "import sys; print(sys.argv[1:])"), 60, quick_argv=("--quick",))
    assert run_row(row, quick=True, env=ENV)["command"].endswith("--quick")


def test_every_row_runs_a_script_that_exists_and_fits_a_device_command():
    for row in ROWS:
        script = next(a for a in row.argv if a.endswith(".py"))
        assert (ROOT / script).exists(), row.name
        assert row.timeout_s <= 540, f"{row.name}: a device command runs at most 600 s"


GPU_MARK = re.compile(r"^\s*@?pytest\.mark\.gpu\b", re.M)  # a decorator or a pytestmark entry


def test_the_gpu_tests_row_runs_every_file_that_holds_gpu_tests():
    marked = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if GPU_MARK.search(p.read_text())}
    assert marked == set(GPU_TEST_FILES)
