"""What an installed bigclip promises: `python -m bigclip`, `bigclip --version` from the one place
the version is written, a wheel that carries its license, notices and the DeepSpeed configs, and
`--deepspeed-config zero3` by name from any folder (DeepSpeed's `--deepspeed_config` too)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import bigclip
from bigclip.cli_args import parse_train_args
from bigclip.engines.deepspeed_config import SHIPPED, find_ds_config, load_ds_config, shipped_ds_configs
from bigclip.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DS_NAMES = ["zero1", "zero2", "zero3", "zero3_offload", "zero3_vit_bigg"]


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bigclip", *args], capture_output=True, text=True, timeout=120
    )


def test_python_m_bigclip_is_the_console_script_and_prints_the_version():
    version = run_module("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"bigclip {bigclip.__version__}"
    usage = run_module()
    assert usage.returncode == 0 and "commands:" in usage.stdout and "train" in usage.stdout
    unknown = run_module("trian")
    assert unknown.returncode == 2 and "unknown command 'trian'" in unknown.stderr


def test_the_version_is_written_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "bigclip.__version__"}
    assert project["project"]["license"] == "MIT" and (ROOT / "LICENSE").is_file()


def test_shipped_configs_by_name_from_any_folder(tmp_path, monkeypatch):
    assert shipped_ds_configs() == DS_NAMES
    monkeypatch.chdir(tmp_path)  # outside a checkout: only the package data is there
    for spelling in ("zero3", "zero3.json", "ds_configs/zero3.json"):
        assert find_ds_config(spelling) == SHIPPED / "zero3.json"
    assert load_ds_config("zero3")["zero_optimization"]["stage"] == 3
    mine = tmp_path / "zero3.json"  # a file of the user's wins over the shipped name
    mine.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert load_ds_config("zero3.json")["zero_optimization"]["stage"] == 2
    with pytest.raises(ConfigError, match="zero4: file not found.* zero1, zero2, zero3, zero3_offload"):
        load_ds_config("zero4")


def test_the_checkouts_ds_configs_folder_is_the_package_data():
    for name in DS_NAMES:
        assert (ROOT / "ds_configs" / f"{name}.json").read_bytes() == (SHIPPED / f"{name}.json").read_bytes()


@pytest.mark.parametrize("flag", ["--deepspeed-config", "--deepspeed_config"])
def test_deepspeeds_own_spelling_is_accepted(flag):
    cfg = parse_train_args(["--engine", "deepspeed", flag, "zero2"])
    assert cfg.engine.deepspeed_config == "zero2"


@pytest.mark.slow
def test_the_wheel_carries_license_notices_version_and_package_data(tmp_path):
    source = tmp_path / "src"  # a copy, so the build leaves no build/ folder in the checkout
    shutil.copytree(ROOT / "bigclip", source / "bigclip", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(tmp_path), str(source)], check=True, timeout=600)
    (wheel,) = tmp_path.glob("bigclip-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"bigclip-{bigclip.__version__}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert f"Version: {bigclip.__version__}\n" in metadata and "License-Expression: MIT\n" in metadata
    assert "Copyright (c) 2021 OpenAI" in license_text and "Gabriel Ilharco" in license_text
    shipped = {f"bigclip/engines/ds_configs/{name}.json" for name in DS_NAMES}
    data = {"bigclip/data/bpe_simple_vocab_16e6.txt.gz", "bigclip/models/configs/ViT-bigG-14.json"}
    assert shipped | data | {"bigclip/__main__.py"} <= names
