"""pyproject.toml's lower bounds are the versions CI tests (tests/support/stacks.py).

`make test-low` installs torch 2.11.0 (the GPU machines' stack, with the Triton it pins) and every
other direct dependency at its declared lower bound into .venv-low, then runs the subset there.
On that stack, each installed version must equal its bound: a bound raised without installing
it, or an install that drifted above it, fails here.
"""

from __future__ import annotations

import os
import platform
import re
from importlib.metadata import PackageNotFoundError, version

import pytest
from support.stacks import (
    LOW_STACK_ENV,
    LOW_STACK_TESTS,
    ROOT,
    constraints,
    core_names,
    existing_tests,
    lower_bounds,
)

ON_LOW_STACK = os.environ.get(LOW_STACK_ENV) == "low"


def _release(text: str) -> tuple[int, ...]:
    """2.11.0+cu130 -> (2, 11, 0): the release a local label or a .postN belongs to."""
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0].split(".post")[0]))


@pytest.mark.skipif(
    not ON_LOW_STACK,
    reason=f"runs on the low stack only ({LOW_STACK_ENV}=low, set by `make test-low`), where every "
    "direct dependency is installed at its lower bound; the main stack has the newest releases",
)
def test_every_direct_dependency_is_installed_at_its_declared_lower_bound():
    wrong = []
    for name, bound in sorted(lower_bounds().items()):
        if name == "triton" and (platform.system(), platform.machine()) != ("Linux", "x86_64"):
            continue  # the int8 extra's marker: no Triton wheel elsewhere
        try:
            installed = version(name)
        except PackageNotFoundError:
            wrong.append(f"{name}: not installed (pyproject.toml declares >={bound})")
            continue
        if _release(installed) != _release(bound):
            wrong.append(f"{name}: {installed} installed, pyproject.toml declares >={bound}")
    assert not wrong, "the low stack is not pyproject.toml's lower bounds:\n  " + "\n  ".join(wrong)


def test_constraints_pin_each_bound_and_the_gpu_machines_torch():
    pins = dict(line.split("==") for line in constraints().splitlines())
    assert pins == lower_bounds()
    assert (pins["torch"], pins["triton"]) == ("2.11.0", "3.6.0")  # the GPU machines' stack
    assert "safetensors" in pins and "bigclip" not in pins


def test_the_subset_names_real_tests():
    """Every entry is a test file, or a FILE::TEST node id, of this tree: nothing drops out silently."""
    assert existing_tests() == list(LOW_STACK_TESTS)
    for entry in LOW_STACK_TESTS:
        path, _, test = entry.partition("::")
        assert (ROOT / path).suffix == ".py", entry
        assert not test or f"def {test}(" in (ROOT / path).read_text(), f"{entry}: no such test"


def test_every_core_dependency_is_imported_by_bigclip():
    """A core dependency is one bigclip/ imports (safetensors was declared but never imported:
    bigclip reads and writes the format itself; the tests' reference files use the package)."""
    modules = {"pillow": "PIL", "pyyaml": "yaml", "tensorboard": "torch.utils.tensorboard"}
    sources = "\n".join(p.read_text() for p in (ROOT / "bigclip").rglob("*.py"))
    unused = [
        name
        for name in core_names()
        if not re.search(
            rf"^\s*(import|from) {re.escape(modules.get(name, name.replace('-', '_')))}\b", sources, re.M
        )
    ]
    assert not unused, f"declared in pyproject.toml's dependencies but never imported by bigclip/: {unused}"
