"""`make wheelhouse`: an air-gapped node installs bigclip from the wheelhouse alone.

Built for this machine's Python and platform with the [s3] extra, then installed into a fresh
virtual environment with `pip install --no-index` (torch, which the wheelhouse leaves to the
node, from a folder of its own), and imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv

import pytest
import torch

from bigclip.launch.wheelhouse import FROM_TORCH, build_wheelhouse, platform_tags

pytestmark = pytest.mark.slow


def test_platform_tags_cover_older_manylinux():
    tags = platform_tags("manylinux_2_28_x86_64")
    assert (
        tags[0] == "manylinux_2_28_x86_64"
        and "manylinux_2_17_x86_64" in tags
        and "manylinux2014_x86_64" in tags
    )
    assert platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_wheelhouse_installs_without_an_index(tmp_path):
    if not sysconfig.get_platform().startswith("linux-x86_64"):
        pytest.skip("builds manylinux x86_64 wheels")
    house = tmp_path / "house"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    build_wheelhouse(
        python_version=python, platform="manylinux_2_28_x86_64", extras="s3", deepspeed="", out=house
    )
    assert not [p.name for p in house.glob("*.whl") if FROM_TORCH.match(p.name.split("-")[0].lower())]
    torch_dir = tmp_path / "torch"
    version = torch.__version__.split("+")[0]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "download", "-q", "--no-deps", "-d", str(torch_dir), f"torch=={version}"], check=True
    )
    venv.create(tmp_path / "venv", with_pip=True)
    node = str(tmp_path / "venv" / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the node has no checkout
    # --no-compile: the node imports a few of torch's thousands of modules (pip compiles them all)
    install = [node, "-m", "pip", "install", "-q", "--no-compile", "--no-index"]
    subprocess.run([*install, "--find-links", str(torch_dir), "--find-links", str(house), "bigclip[s3]"],
                   env=env, check=True)  # fmt: skip
    code = "import bigclip.train, boto3, s3torchconnector.dcp; print(bigclip.__file__)"
    done = subprocess.run(
        [node, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, check=True
    )
    assert str(tmp_path / "venv") in done.stdout  # the installed wheel, not this checkout
