"""The project's GPU machines run the GPU tests and `make bench-gpu` from a checkout once the
wheels of `make gpu-wheels` are installed there: nothing else is missing.

Those machines reach no package index; their image holds torch, Triton, torchvision, pytest,
pyyaml, pillow, numpy, safetensors, tensorboard, regex, tqdm and more, but not braceexpand or
ftfy (the machines' package list as read on 2026-11-17). Every device minute spent on a missing
import is lost. Simulated here: a fresh virtual environment with the part of that image bigclip
touches (a CPU torch; no torchvision, which bigclip does not use) plus the wheels of the
Makefile's GPU_IMAGE_LACKS, installed as the session would: `--no-index --no-deps`. Then the GPU
tests must collect and skip (no CUDA here) and every row that needs no optional package must get
past its imports.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch

from bigclip.launch.wheelhouse import download_only

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_suite import GPU_TEST_FILES, ROWS  # noqa: E402

IMAGE = [
    "numpy",
    "safetensors",
    "tensorboard",
    "regex",
    "tqdm",
    "pillow",
    "pyyaml",
    "pytest",
    "packaging",
    "psutil",
]


def gpu_image_lacks() -> list[str]:
    found = re.search(r"^GPU_IMAGE_LACKS \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, "Makefile: GPU_IMAGE_LACKS ?= ... not found"
    return found.group(1).split()


@pytest.fixture(scope="module")
def image_python(module_tmp) -> str:
    if not sysconfig.get_platform().startswith("linux-x86_64"):
        pytest.skip("downloads manylinux x86_64 wheels")
    tmp = module_tmp("gpu-image")
    wheels, lacks = tmp / "gpu-wheels", gpu_image_lacks()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    download_only(lacks, python_version=python, platform="manylinux_2_28_x86_64", out=wheels)
    venv.create(tmp / "venv", with_pip=True)
    image = str(tmp / "venv" / "bin" / "python")
    torch_version = torch.__version__.split("+")[0]
    pip = [image, "-m", "pip", "install", "-q", "--no-compile"]  # compiled as imported: a fraction
    subprocess.run([*pip, f"torch=={torch_version}", *IMAGE], check=True, env=clean_env())
    carried = [str(w) for w in wheels.glob("*.whl")]
    subprocess.run([*pip, "--no-index", "--no-deps", *carried], check=True, env=clean_env())
    return image


# This machine's venv stays out; bytecode may be written, so the modules the rows import (installed
# uncompiled) are compiled once, not in every row.
NOT_CARRIED = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")


def clean_env() -> dict[str, str]:
    """The checkout on PYTHONPATH, as `make bench-gpu` runs; nothing from this machine's venv."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_CARRIED}
    return {**env, "PYTHONPATH": str(ROOT)}


def run(image: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [image, *argv], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600
    )


def test_the_suite_lists_its_rows_on_the_image(image_python):
    assert run(image_python, "benchmarks/gpu_suite.py", "--list").returncode == 0


def test_gpu_tests_collect_and_skip_on_the_image(image_python):
    done = run(image_python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TEST_FILES)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\d+ skipped", done.stdout) and "error" not in done.stdout.lower(), done.stdout[-2000:]


@pytest.mark.parametrize("row", [r for r in ROWS if not r.needs], ids=lambda r: r.name)
def test_rows_without_optional_packages_import_on_the_image(image_python, row):
    done = run(image_python, *row.argv, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
