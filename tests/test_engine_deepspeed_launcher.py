"""The deepspeed launcher itself: `deepspeed --num_gpus 2 ...` on CPU starts two ranks that take
their rank, world size and local rank from the launcher and train like the unsharded model.

(`bigclip.train` needs the data package; until it is merged the launcher drives
tests/deepspeed_launch_target.py, which goes through the same setup and engine path.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import assert_same_weights
from test_engine_deepspeed import DS_CONFIGS, config, reference

from bigclip.config import TrainConfig
from bigclip.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_deepspeed_launcher_two_ranks_on_cpu(tmp_path):
    steps, batch = 4, 4
    command = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus", "2",
        "--master_port", str(free_port()),
        str(ROOT / "tests" / "deepspeed_launch_target.py"),
        "--engine", "deepspeed",
        "--deepspeed-config", str(DS_CONFIGS / "zero3.json"),
        "--model", "tiny", "--precision", "fp32",
        "--batch-size", str(batch), "--max-steps", str(steps),
        "--lr", "1e-3", "--warmup", "0", "--wd", "0.1", "--local-loss", "--gather-with-grad",
        "--logs", str(tmp_path),
    ]  # fmt: skip
    env = os.environ | {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "launch_result.json").read_text())
    assert result["world_size"] == 2
    assert [(r["rank"], r["local_rank"], r["arg"]) for r in result["ranks"]] == [(0, 0, 0), (1, 1, 1)]
    unsharded = reference(TrainConfig.from_dict(config("fsdp")).validate(), steps, batch * 2)
    assert result["losses"] == pytest.approx(unsharded["losses"], rel=1e-4)
    assert_same_weights(unsharded["weights"], torch.load(tmp_path / "weights.pt"), rtol=1e-4)
