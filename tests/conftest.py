"""Shared fixtures and the suite's scheduling.

`make test` runs the suite in two pytest-xdist workers. Each test file is one unit of work, so a
module's expensive fixtures are built once, in one worker; the files that run a real Slurm cluster
are one unit together (their daemons, ports and network namespaces cannot coexist) and come first,
as they spend most of their time waiting on the scheduler while the other worker keeps the CPUs
busy. (`pytest_xdist_make_scheduler` below, rather than xdist_group marks: xdist 3.8 groups by a
suffix it writes into `item._nodeid`, which pytest 9.2's nodes no longer read.)
"""

from __future__ import annotations

from typing import Any

import pytest

from bigclip.demo.data import DemoData, write_demo_data

CLUSTER_MODULES = ("test_slurm_cluster.py", "test_slurm_two_nodes.py", "test_slurm_two_nodes_faults.py")


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    """1,536 captioned training images in 4 shards and 200 held-out ones (64 px, the tiny model's size)."""
    out = tmp_path_factory.mktemp("demo_data")
    return write_demo_data(str(out), samples=1536, shards=4, val_samples=200, seed=0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The bad-input suite (tests/test_bad_input_*.py) is marked `bad_input`: `make test` runs it,
    `make test-fast` leaves it out (each row is a real command line, a process each). The real-Slurm
    files go first (the order xdist hands out units in)."""
    for item in items:
        if item.path.name.startswith("test_bad_input_"):
            item.add_marker(pytest.mark.bad_input)
    items.sort(key=lambda item: item.path.name not in CLUSTER_MODULES)  # stable: file order otherwise


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
