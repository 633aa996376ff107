"""DeepSpeed checkpoints through torch.distributed.checkpoint: saved at 2 ranks, resumed at 3.

A run saves after a few steps and carries on; a fresh engine at another world size loads the
checkpoint, saves it again and carries on too. The two checkpoints hold the same tensors bit for
bit (weights, Adam moments, steps), and the resumed run continues the original one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from engine_harness import assert_same_weights
from test_engine_deepspeed import config, make_engine, run_steps
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from bigclip.config import TrainConfig
from bigclip.distributed import spawn

pytestmark = pytest.mark.dist
BATCH, BEFORE, AFTER = 12, 3, 2  # 12: every rank of 2 and of 3 gets whole slices


def save_and_continue(rank: int, world: int, cfg_dicts: list[dict], root: str) -> list[dict]:
    """Worker: train, save to ROOT/i/saved, train on."""
    out = []
    for i, c in enumerate(cfg_dicts):
        cfg = TrainConfig.from_dict(c).validate()
        engine = make_engine(rank, world, cfg)
        run_steps(engine, cfg, range(BEFORE), BATCH)
        dcp.save(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/saved")
        losses = run_steps(engine, cfg, range(BEFORE, BEFORE + AFTER), BATCH)
        out.append({"losses": losses, "weights": engine.full_state_dict()})
    return out


def resume_and_continue(rank: int, world: int, cfg_dicts: list[dict], root: str) -> list[dict]:
    """Worker: a fresh engine loads ROOT/i/saved, saves it again to ROOT/i/resaved, trains on."""
    out = []
    for i, c in enumerate(cfg_dicts):
        cfg = TrainConfig.from_dict(c).validate()
        engine = make_engine(rank, world, cfg)
        dcp.load(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/saved")
        dcp.save(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/resaved")
        losses = run_steps(engine, cfg, range(BEFORE, BEFORE + AFTER), BATCH)
        out.append({"losses": losses, "weights": engine.full_state_dict()})
    return out


def whole(folder: Path) -> dict:
    """A DCP checkpoint read back as full tensors, flattened to 'a.b.c' keys."""
    target = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(folder, target)
    flat: dict = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, list):
            for k, v in enumerate(value):
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    walk("", torch.load(target, weights_only=False))
    return flat


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_zero2_and_zero3_checkpoints_reshard_from_2_to_3_ranks(tmp_path):
    cfgs = [config("zero2"), config("zero3")]
    original = spawn(save_and_continue, 2, cfgs, str(tmp_path))[0]
    resumed = spawn(resume_and_continue, 3, cfgs, str(tmp_path))[0]
    for i, name in enumerate(("zero2", "zero3")):
        saved, resaved = whole(tmp_path / str(i) / "saved"), whole(tmp_path / str(i) / "resaved")
        assert any(k.endswith("exp_avg_sq") for k in saved), name
        assert saved["model.visual.conv1.weight"].shape == (64, 3, 8, 8)  # true shapes, OpenCLIP names
        assert_bitwise_equal(saved, resaved)
        assert resumed[i]["losses"] == pytest.approx(original[i]["losses"], rel=1e-4), name
        assert_same_weights(original[i]["weights"], resumed[i]["weights"], rtol=1e-4)
