"""The order `make test` hands test files to its workers: the real-Slurm unit, in a worker of its
own from three workers, then the files that cost most in the last recorded run
(benchmarks/test_times.py records them per stack). The scheduler is xdist's own class, driven here
through its calls from xdist's session, with handles that record what each worker is sent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import CLUSTER_MODULES, file_order, recorded_costs
from support.file_scheduling import FileScheduling

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


class Worker:
    """What xdist's session sees of a worker: it is sent test indices and told to shut down, and, as
    xdist's worker, runs a test only once it knows what follows (the next test, or the end)."""

    def __init__(self, name):
        self.name, self.sent, self.done, self.shutting_down = name, [], 0, False
        self.gateway = type("Gateway", (), {"id": name})()  # named in xdist's collection check

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True

    def can_run(self):
        return self.done < len(self.sent) - (0 if self.shutting_down else 1)


def run_schedule(workers: int, files: list[str]) -> tuple[dict[str, list[str]], dict[str, int]]:
    """The files each worker ran, and how many of the suite's tests were left when it finished its
    last; the workers finish tests in turn."""
    config = SimpleNamespace(  # `-n workers`, the order kept as conftest's hook keeps it
        getvalue={"tx": [f"{workers}*popen"]}.get, option=SimpleNamespace(loadscopereorder=False)
    )
    sched = FileScheduling(config)
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    collection = [f"tests/{name}::test_{i}" for name in files for i in range(3)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    left_when_done: dict[str, int] = {}
    for count in range(1, len(collection) + 1):
        if sched.tests_finished:  # xdist's session then tells every worker to end
            for node in nodes:
                node.shutdown()
        runnable = [node for node in nodes if node.can_run()]
        assert runnable, "every worker waits on the scheduler"
        node = min(runnable, key=lambda n: n.done)
        sched.mark_test_complete(node, node.sent[node.done])
        node.done += 1
        left_when_done[node.name] = len(collection) - count
    ran = {n.name: list(dict.fromkeys(collection[i].split("::")[0][6:] for i in n.sent)) for n in nodes}
    assert sorted(sum(ran.values(), [])) == sorted(files)  # each file once, whole
    assert all(node.done == len(node.sent) for node in nodes)
    return ran, left_when_done


FILES = [*CLUSTER_MODULES, "test_zeroshot.py", "test_plan.py", *(f"test_{c}.py" for c in "abcdefghijklmnop")]


def test_from_three_workers_the_slurm_unit_has_one_of_its_own_that_ends_with_it():
    ran, left_when_done = run_schedule(3, FILES)
    assert ran["gw0"] == list(CLUSTER_MODULES)
    assert left_when_done["gw0"] > 20  # its last test is not held back to the suite's end
    assert {"gw1", "gw2"} == {
        name for name, files in ran.items() if "test_zeroshot.py" in files or "test_plan.py" in files
    }


@pytest.mark.parametrize("files", [FILES, FILES[3:]], ids=["with-slurm", "without"])
def test_with_two_workers_or_no_slurm_unit_every_worker_takes_any_file(files):
    for workers in (2, 3) if files is not FILES else (2,):
        ran, _ = run_schedule(workers, files)
        assert all(len(files_run) > 1 for files_run in ran.values())
