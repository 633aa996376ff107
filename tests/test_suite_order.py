"""The order `make test` hands test files to its two workers: the real-Slurm unit, then the files
that cost most in the last recorded run (benchmarks/test_times.py records them per stack)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from conftest import CLUSTER_MODULES, file_order, recorded_costs

ROOT = Path(__file__).resolve().parents[1]


def load_test_times():
    spec = importlib.util.spec_from_file_location(
        "test_times_benchmark", ROOT / "benchmarks" / "test_times.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE_TEST_OUTPUT = """\
============================= slowest 30 durations =============================
120.50s setup    tests/test_slurm_cluster.py::test_uninterrupted
60.00s call     tests/test_zeroshot.py::test_demo
20.00s call     tests/test_zeroshot.py::test_other
1500 passed, 3 skipped in 1400.10s (0:23:20)
============================= slowest 30 durations =============================
40.00s call     tests/test_flag_matrix.py::test_rows[zero3]
380 passed in 400.00s (0:06:40)
"""


def test_each_stacks_slowest_tests_are_kept_apart_and_summed_per_file(tmp_path):
    slowest = load_test_times().slowest_by_stack(MAKE_TEST_OUTPUT, ["main", "low"])
    assert [len(slowest["main"]), len(slowest["low"])] == [3, 1]
    (tmp_path / "t.json").write_text(json.dumps({"rows": [{"tier": "test", "slowest": slowest}]}))
    assert recorded_costs("main", tmp_path / "t.json") == {
        "test_slurm_cluster.py": 120.5,
        "test_zeroshot.py": 80.0,
    }
    assert recorded_costs("low", tmp_path / "t.json") == {"test_flag_matrix.py": 40.0}


def test_the_slurm_unit_goes_first_then_the_costliest_files_then_the_rest(tmp_path):
    costs = recorded_costs("main", tmp_path / "missing.json")
    assert not costs  # nothing recorded: the files' own order
    costs.update({"test_zeroshot.py": 80.0, "test_plan.py": 5.0})
    files = ["test_a.py", "test_plan.py", CLUSTER_MODULES[1], "test_zeroshot.py", "test_b.py"]
    ordered = sorted(files, key=lambda name: file_order(name, costs))
    assert ordered == [CLUSTER_MODULES[1], "test_zeroshot.py", "test_plan.py", "test_a.py", "test_b.py"]


def test_an_older_record_without_stacks_gives_no_order(tmp_path):
    (tmp_path / "t.json").write_text(
        json.dumps({"rows": [{"tier": "test", "slowest": ["9.0s call tests/test_a.py::t"]}]})
    )
    assert not recorded_costs("main", tmp_path / "t.json")
