"""Checkpoints through torch.distributed.checkpoint: saved at 2 ranks, resumed at 3.

A run saves after a few steps and carries on; a fresh engine at another world size (the same
engine, or the other one) loads the checkpoint, saves it again and carries on too. The two
checkpoints hold the same tensors bit for bit (weights, Adam moments, steps), and the resumed run
continues the original one. Both spawned worlds serve all tests (DeepSpeed's start-up dominates).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_harness import whole_checkpoint
from support.engine_harness import assert_same_weights, make_engine, run_steps
from test_engine_deepspeed import config

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


def resume_and_continue(rank: int, world: int, plan: list[tuple[dict, int]], root: str) -> list[dict]:
    """Worker: for each (config, i), a fresh engine loads ROOT/i/saved, saves it again to
    ROOT/i/resaved-<n> and trains on."""
    out = []
    for n, (c, i) in enumerate(plan):
        cfg = TrainConfig.from_dict(c).validate()
        engine = make_engine(rank, world, cfg)
        dcp.load(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/saved")
        dcp.save(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/resaved-{n}")
        losses = run_steps(engine, cfg, range(BEFORE, BEFORE + AFTER), BATCH)
        out.append({"losses": losses, "weights": engine.full_state_dict()})
    return out


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


EIGHT_BIT = {"optim.optimizer": "adamw8bit"}
SAVED = {"zero2": config("zero2"), "zero3": config("zero3"), "fsdp": config("fsdp")}
SAVED |= {"zero3-pure-bf16": config("zero3", **{"engine.precision": "pure_bf16"})}
SAVED |= {"zero2-8bit": config("zero2", **EIGHT_BIT), "fsdp-8bit": config("fsdp", **EIGHT_BIT)}
# (engine that resumes, checkpoint it resumes from)
EXACT = [
    ("zero2", "zero2"),
    ("zero3", "zero3"),
    ("fsdp", "zero3"),  # across engines, both ways
    ("zero2", "fsdp"),
    ("zero3-pure-bf16", "zero3-pure-bf16"),  # bf16 master weights and moments
]
EIGHT_BIT_RESUMES = [("zero2-8bit", "zero2-8bit"), ("fsdp-8bit", "fsdp-8bit")]
RESUMES = EXACT + EIGHT_BIT_RESUMES


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Save at 2 ranks, resume at 3 ranks, once for all the tests below."""
    root = tmp_path_factory.mktemp("ckpt")
    names = list(SAVED)
    original = spawn(save_and_continue, 2, list(SAVED.values()), str(root))[0]
    plan = [(SAVED[engine], names.index(source)) for engine, source in RESUMES]
    resumed = spawn(resume_and_continue, 3, plan, str(root))[0]
    out = {"original": dict(zip(names, original)), "saved": {}, "resumed": {}}
    for n, ((engine, source), run) in enumerate(zip(RESUMES, resumed)):
        folder = root / str(names.index(source))
        out["saved"][source] = whole_checkpoint(folder / "saved")
        out["resumed"][(engine, source)] = {**run, "resaved": whole_checkpoint(folder / f"resaved-{n}")}
    return out


@pytest.mark.parametrize(("engine", "source"), EXACT)
def test_checkpoint_resumes_at_another_world_size_bitwise(runs, engine, source):
    """Saved at 2 ranks, loaded at 3 (by the same or the other engine) and saved again: the same
    tensors bit for bit (weights, Adam moments and steps, under OpenCLIP names and true shapes),
    and training continues as if it had never stopped."""
    saved, resumed = runs["saved"][source], runs["resumed"][(engine, source)]
    assert saved["model.visual.conv1.weight"].shape == (64, 3, 8, 8)
    assert "optim.optimizer.state.visual.conv1.weight.exp_avg_sq" in saved
    assert_bitwise_equal(saved, resumed["resaved"])
    original = runs["original"][source]
    rtol = 1e-2 if "bf16" in engine else 1e-4
    assert resumed["losses"] == pytest.approx(original["losses"], rel=rtol)
    assert_same_weights(original["weights"], resumed["weights"], rtol=rtol)


@pytest.mark.parametrize("name", ["zero2-8bit", "fsdp-8bit"])
def test_8bit_optimizer_state_reshards_through_fp32(runs, name):
    """8-bit moments are saved dequantised, so they reshard; at 3 ranks the quantisation blocks
    differ and the moments are re-quantised (8-bit rounding), the weights are unchanged."""
    saved, resumed = runs["saved"][name], runs["resumed"][(name, name)]
    for key, value in saved.items():
        if key.startswith("model."):
            assert torch.equal(value, resumed["resaved"][key]), key
        elif key.endswith("exp_avg_sq") and value.numel() > 1000:
            error = (value - resumed["resaved"][key]).norm() / value.norm()
            assert 0 <= error < 0.05, key
    assert resumed["losses"] == pytest.approx(runs["original"][name]["losses"], rel=1e-3)
