"""A run on local files needs nothing but torch (and bigclip's own light dependencies).

GPU images and air-gapped cluster nodes often lack the S3 libraries, DeepSpeed, bitsandbytes
or Triton. Training from local shards to a local checkpoint folder must neither need nor load
them; an option that does need one must fail in seconds, naming the package to install.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.train_harness import demo_argv

pytestmark = pytest.mark.dist

OPTIONAL = ("boto3", "botocore", "s3transfer", "s3torchconnector", "s3torchconnectorclient", "webdataset",
            "deepspeed", "bitsandbytes", "triton", "wandb")  # fmt: skip

# Loaded by torch and TensorBoard themselves whenever they are installed, not by bigclip:
# torch._dynamo (imported by FSDP2) probes for triton, and TensorBoard's file layer probes for
# boto3/botocore to offer S3 paths. The missing-packages run shows neither needs them.
LOADED_BY_OTHERS = {"triton", "boto3", "botocore", "s3transfer"}

# Makes the optional packages unimportable, as on a machine where they are not installed.
BLOCKER = f"""
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _NotInstalled())
"""
TRAIN = """
import json, runpy, sys
sys.argv = ["bigclip.train", *json.loads(sys.argv[1])]
try:
    runpy.run_module("bigclip.train", run_name="__main__")
finally:
    loaded = sorted({name.partition(".")[0] for name in sys.modules} & set(OPTIONAL))
    print("LOADED " + json.dumps(loaded), flush=True)
"""


def run_training(argv: list[str], *, block: bool, timeout_s: float = 300) -> subprocess.CompletedProcess:
    code = (BLOCKER if block else "") + f"OPTIONAL = {OPTIONAL!r}\n" + TRAIN
    return subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip


def loaded_packages(done: subprocess.CompletedProcess) -> list[str]:
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOADED "))
    return json.loads(line.removeprefix("LOADED "))


def local_argv(demo_data, tmp_path: Path, name: str, *extra: str) -> list[str]:
    return demo_argv(demo_data, tmp_path, "--max-steps", "2", "--save-every-n-steps", "2", *extra, name=name)


@pytest.mark.parametrize("block", [True, False], ids=["packages-missing", "packages-installed"])
def test_local_training_needs_and_loads_no_optional_package(demo_data, tmp_path, block):
    done = run_training(local_argv(demo_data, tmp_path, "local"), block=block)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "local" / "checkpoints" / "step_00000002" / "manifest.json").exists()
    loaded = set(loaded_packages(done))
    assert loaded == set() if block else loaded <= LOADED_BY_OTHERS, loaded


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


@pytest.mark.parametrize(
    ("flag", "value", "package"),
    [
        ("--checkpoint-dir", "s3://some-bucket/ckpt", "s3torchconnector"),
        ("--train-data", "s3://some-bucket/shards/{00000..00003}.tar", "boto3"),
        ("--report-to", "wandb", "wandb"),
    ],
)
def test_an_option_that_needs_a_missing_package_fails_fast_naming_it(
    demo_data, tmp_path, flag, value, package
):
    """Refused while checking the run's inputs, before a model is built (the timeout guards a hang)."""
    argv = with_flag(local_argv(demo_data, tmp_path, "s3"), flag, value)
    done = run_training(argv, block=True, timeout_s=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert package in done.stderr and "pip install" in done.stderr, done.stderr[-2000:]
