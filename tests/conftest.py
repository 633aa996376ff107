"""Shared fixtures and the suite's scheduling.

`make test` runs the suite in two pytest-xdist workers. Each test file is one unit of work, so a
module's expensive fixtures are built once, in one worker; the files that run a real Slurm cluster
are one unit together (their daemons, ports and network namespaces cannot coexist) and come first,
as they spend most of their time waiting on the scheduler while the other worker keeps the CPUs
busy. The other files follow, the most expensive first (by the last recorded `make test`:
`python benchmarks/test_times.py` keeps each stack's slowest tests), so that no long file is left
to run alone at the end while the other worker idles. (`pytest_xdist_make_scheduler` below,
rather than xdist_group marks: xdist 3.8 groups by a suffix it writes into `item._nodeid`, which
pytest 9.2's nodes no longer read.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bigclip.demo.shapes_data import DemoData, write_demo_data

CLUSTER_MODULES = ("test_slurm_cluster.py", "test_slurm_two_nodes.py", "test_slurm_two_nodes_faults.py")
TEST_TIMES = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "test_times.json"
DURATION = re.compile(r"([\d.]+)s \w+\s+(?:\S*/)?(test_\w+\.py)")  # "69.02s setup    tests/test_x.py::..."


def recorded_costs(stack: str, path: Path = TEST_TIMES) -> Counter[str]:
    """Seconds per test file among the slowest tests of `stack`'s last recorded `make test` (none
    when nothing is recorded: the order is then the files' own)."""
    try:
        rows = json.loads(path.read_text())["rows"]
        lines = next(r["slowest"] for r in rows if r["tier"] == "test")[stack]
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return Counter()
    costs: Counter[str] = Counter()
    for m in filter(None, map(DURATION.match, lines)):
        costs[m.group(2)] += float(m.group(1))
    return costs


@pytest.fixture(scope="module")
def module_tmp(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Path]]:
    """`tmp_path_factory.mktemp` for one test file's shared runs, whose folders are removed once the
    file's tests are done unless one of them failed. pytest removes a passed test's own `tmp_path`
    but keeps every `mktemp` folder to the end of the run: the checkpoints and clusters of a whole
    run came to 6-9 GB there, more than a CI machine's disk sometimes has free."""
    made: list[Path] = []
    failed = request.session.testsfailed

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    """1,536 captioned training images in 4 shards and 200 held-out ones (64 px, the tiny model's size)."""
    out = tmp_path_factory.mktemp("demo_data")
    return write_demo_data(str(out), samples=1536, shards=4, val_samples=200, seed=0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The bad-input suite (tests/test_bad_input_*.py) is marked `bad_input`: `make test` runs it,
    `make test-fast` leaves it out (each row is a real command line, a process each). The real-Slurm
    files go first (the order xdist hands out units in), then the most expensive files."""
    for item in items:
        if item.path.name.startswith("test_bad_input_"):
            item.add_marker(pytest.mark.bad_input)
    costs = recorded_costs("low" if os.environ.get("BIGCLIP_STACK") == "low" else "main")
    items.sort(key=lambda item: file_order(item.path.name, costs))  # stable: a file's tests keep their order


def file_order(name: str, costs: Counter[str]) -> tuple[bool, float]:
    """Sort key of a test file: the real-Slurm files, then by recorded cost, the most first."""
    return name not in CLUSTER_MODULES, -costs[name]


@pytest.hookimpl(optionalhook=True)  # a venv without xdist (test_gpu_image's) runs this conftest too
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """One unit of work per test file, the real-Slurm files one unit, in collection order."""
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):  # xdist's --dist loadfile, the cluster files merged
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "real-slurm" if path.rsplit("/", 1)[-1] in CLUSTER_MODULES else path

    config.option.loadscopereorder = False  # keep the order above: the long, mostly idle unit first
    return FileScheduling(config, log)
