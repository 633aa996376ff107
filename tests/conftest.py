"""Shared fixtures: demo data written once per test session."""

from __future__ import annotations

import pytest

from bigclip.demo.data import DemoData, write_demo_data


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    """1,536 captioned training images in 4 shards and 200 held-out ones (64 px, the tiny model's size)."""
    out = tmp_path_factory.mktemp("demo_data")
    return write_demo_data(str(out), samples=1536, shards=4, val_samples=200, seed=0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The bad-input suite (tests/test_bad_input_*.py) is marked `bad_input`: `make test` runs it,
    `make test-fast` leaves it out (each row is a real command line, a process each)."""
    for item in items:
        if item.path.name.startswith("test_bad_input_"):
            item.add_marker(pytest.mark.bad_input)
