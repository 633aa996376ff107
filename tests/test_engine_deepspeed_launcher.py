"""The deepspeed launcher itself, on the real entry point: `deepspeed --num_gpus 2 --module
bigclip.train --engine deepspeed ...` on CPU trains on demo data and checkpoints; the ZeRO-3
checkpoint then resumes under FSDP2 on one rank through the same trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.train_harness import demo_argv, resume_and_inspect

from bigclip.distributed import free_port, spawn

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_deepspeed_launcher_trains_and_its_checkpoint_resumes_under_fsdp(demo_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = demo_argv(demo_data, tmp_path, "--max-steps", "6", "--batch-size", "16", "--checkpoint-dir", str(ckpt),
                     name="ds")  # fmt: skip
    command = [
        str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
        "--module", "bigclip.train", "--engine", "deepspeed",
        "--deepspeed-config", str(ROOT / "ds_configs" / "zero3.json"), *argv,
    ]  # fmt: skip
    env = os.environ | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "ds" / "out.log").read_text()
    assert "2 rank(s), engine deepspeed" in log
    manifest = json.loads((ckpt / "step_00000006" / "manifest.json").read_text())
    assert (manifest["engine"], manifest["world_size"]) == ("deepspeed", 2)

    fsdp = demo_argv(demo_data, tmp_path, "--max-steps", "6", "--batch-size", "32", "--checkpoint-dir",
                     str(tmp_path / "ckpt-fsdp"), "--resume", str(ckpt / "step_00000006"), name="fsdp")  # fmt: skip
    restored = spawn(resume_and_inspect, 1, fsdp)[0]
    assert restored["state"]["step"] == 6 and restored["state"]["samples_seen"] == 6 * 32
