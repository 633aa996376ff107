"""Checkpoints through torch.distributed.checkpoint: saved at 2 ranks, resumed at 3.

A run saves after a few steps and carries on; a fresh engine at another world size (the same
engine, or the other one) loads the checkpoint, saves it again and carries on too. The two
checkpoints hold the same tensors bit for bit (weights, Adam moments, steps), and the resumed run
continues the original one. Both spawned worlds serve all tests (DeepSpeed's start-up dominates).

DeepSpeed's state is also saved, in both worlds, by the builder it had before it became
O(this rank's fragments) (tests/support/zero3_state_reference.py): the two checkpoints must be
the same files, `.metadata` and bytes; and the resumed engines save once more through the
store's async path (DCP's stager copies the state to CPU first).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_harness import whole_checkpoint
from support.engine_harness import assert_same_weights, make_engine, run_steps
from support.zero3_state_reference import old_state
from test_engine_deepspeed import config
from torch.distributed.checkpoint import FileSystemReader

from bigclip.checkpoint import CheckpointStore
from bigclip.config import TrainConfig
from bigclip.distributed import spawn

pytestmark = pytest.mark.dist
BATCH, BEFORE, AFTER = 12, 3, 2  # 12: every rank of 2 and of 3 gets whole slices


def save_and_continue(
    rank: int, world: int, cfg_dicts: list[dict], root: str, reference: bool = False
) -> list[dict]:
    """Worker: train, save to ROOT/i/saved (and, with `reference`, a DeepSpeed engine's state by
    the old builder to ROOT/i/saved-old), train on."""
    out = []
    for i, c in enumerate(cfg_dicts):
        cfg = TrainConfig.from_dict(c).validate()
        engine = make_engine(rank, world, cfg)
        run_steps(engine, cfg, range(BEFORE), BATCH)
        dcp.save(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/saved")
        if reference and cfg.engine.engine == "deepspeed":
            dcp.save(old_state(engine), checkpoint_id=f"{root}/{i}/saved-old")
        losses = run_steps(engine, cfg, range(BEFORE, BEFORE + AFTER), BATCH)
        out.append({"losses": losses, "weights": engine.full_state_dict()})
    return out


def resume_and_continue(rank: int, world: int, plan: list[tuple[dict, int]], root: str) -> list[dict]:
    """Worker: for each (config, i), a fresh engine loads ROOT/i/saved, saves it again to
    ROOT/i/resaved-<n> (a DeepSpeed engine also by the old builder, to ROOT/i/resaved-<n>-old,
    and by the store's async save, to ROOT/i/async-<n>) and trains on."""
    out = []
    for n, (c, i) in enumerate(plan):
        cfg = TrainConfig.from_dict(c).validate()
        engine = make_engine(rank, world, cfg)
        dcp.load(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/saved")
        dcp.save(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/resaved-{n}")
        if cfg.engine.engine == "deepspeed":
            dcp.save(old_state(engine), checkpoint_id=f"{root}/{i}/resaved-{n}-old")
            store = CheckpointStore(f"{root}/{i}/async-{n}")
            store.async_save(engine.checkpoint_state(), step=BEFORE).wait()
            store.close()
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
LOCKS = {"model.lock_image": True, "model.lock_image_unlocked_groups": 2, "model.lock_text": True}
SAVED = {"zero2": config("zero2"), "zero3": config("zero3"), "fsdp": config("fsdp")}
SAVED |= {"zero3-pure-bf16": config("zero3", **{"engine.precision": "pure_bf16"})}
SAVED |= {"zero2-8bit": config("zero2", **EIGHT_BIT), "fsdp-8bit": config("fsdp", **EIGHT_BIT)}
SAVED |= {"zero3-locked": config("zero3", **LOCKS)}  # frozen weights: partitions, no moments
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
def runs(module_tmp) -> dict:
    """Save at 2 ranks, resume at 3 ranks, once for all the tests below."""
    root = module_tmp("ckpt")
    names = list(SAVED)
    original = spawn(save_and_continue, 2, list(SAVED.values()), str(root), True)[0]
    plan = [(SAVED[engine], names.index(source)) for engine, source in RESUMES]
    resumed = spawn(resume_and_continue, 3, plan, str(root))[0]
    out = {"original": dict(zip(names, original)), "saved": {}, "resumed": {}, "root": root}
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


def dcp_files(folder) -> dict:
    """Everything a DCP checkpoint folder says, but the per-save id: `.metadata`'s tensor
    metadata (sizes, properties, chunks), where each chunk's bytes are, and every data file."""
    metadata = FileSystemReader(str(folder)).read_metadata()
    return {
        "tensors": metadata.state_dict_metadata,
        "storage": metadata.storage_data,
        "planner": metadata.planner_data,
        "files": {p.name: p.read_bytes() for p in sorted(folder.glob("*.distcp"))},
    }


def folder(source: str) -> str:
    return str(list(SAVED).index(source))


# Each DeepSpeed checkpoint saved by both builders: (by the new one, by the old one), at 2 ranks
# and at 3 after a resume.
BY_BOTH = [(f"{folder(s)}/saved", f"{folder(s)}/saved-old") for s in SAVED if not s.startswith("fsdp")]
BY_BOTH += [
    (f"{folder(s)}/resaved-{n}", f"{folder(s)}/resaved-{n}-old")
    for n, (engine, s) in enumerate(RESUMES)
    if not engine.startswith("fsdp")
]


@pytest.mark.parametrize(("new", "old"), BY_BOTH)
def test_deepspeed_state_saves_the_same_checkpoint_as_the_old_builder(runs, new, old):
    """The state builder that lists only this rank's boxes gives DCP what the one that listed
    every rank's boxes gave it: the same `.metadata` (chunks, sizes, dtypes, where each chunk's
    bytes are) and the same data files, byte for byte (at 2 ranks, and at 3 after a resume)."""
    mine, reference = dcp_files(runs["root"] / new), dcp_files(runs["root"] / old)
    assert mine["tensors"].keys() == reference["tensors"].keys()
    for key, value in reference["tensors"].items():
        assert mine["tensors"][key] == value, key
    assert mine["storage"] == reference["storage"]
    assert mine["planner"] == reference["planner"]
    assert mine["files"].keys() == reference["files"].keys()
    assert all(mine["files"][name] == data for name, data in reference["files"].items())


@pytest.mark.parametrize(("engine", "source"), [r for r in RESUMES if not r[0].startswith("fsdp")])
def test_deepspeed_state_saves_asynchronously(runs, engine, source):
    """The store's async save (DCP's stager copies the state to CPU, then writes in the
    background) commits what a synchronous save of the same state writes."""
    n = RESUMES.index((engine, source))
    committed = runs["root"] / folder(source) / f"async-{n}" / f"step_{BEFORE:08d}"
    assert_bitwise_equal(whole_checkpoint(committed), runs["resumed"][(engine, source)]["resaved"])
