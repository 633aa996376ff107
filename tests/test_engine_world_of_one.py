"""The FSDP engine at a world of one: a plain module (bf16 parameters, fp32 masters under a mixed
precision) that trains as FSDP2 at a world of one does, and checkpoints that resume on two ranks."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.engine_harness import run_steps, tiny_config
from torch.distributed.tensor import DTensor

from bigclip.distributed import Runtime, spawn
from bigclip.engines import build_engine
from bigclip.models.from_config import build_model, model_factory

pytestmark = pytest.mark.dist

BATCH = 8


def engine_at(rank: int, world: int, cfg_dict: dict, *, fsdp2: bool = False):  # noqa: ANN201
    """The engine as a run builds it; `fsdp2`: FSDP2 even at a world of one (the old path)."""
    cfg = tiny_config(**cfg_dict)
    engine = build_engine(
        cfg, Runtime(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    )
    engine.world_of_one &= not fsdp2
    engine.build(build_model(cfg), rebuild=model_factory(cfg))
    torch.manual_seed(1234 + rank)
    return cfg, engine


def train_worker(rank: int, world: int, overrides: dict, fsdp2: bool) -> dict:
    cfg, engine = engine_at(rank, world, overrides, fsdp2=fsdp2)
    losses = run_steps(engine, cfg, range(4), BATCH)
    params = list(engine.module.parameters())
    return {
        "losses": losses,
        "weights": engine.full_state_dict(),
        "dtensors": any(isinstance(p, DTensor) for p in params),
        "dtypes": sorted({str(p.dtype) for p in params}),
    }


# The parameters' dtypes at a world of one: the compute dtype's, and fp32 for the scalars (the
# logit scale) that stay their own masters under a mixed precision.
DTYPES = {
    "amp_bf16": ["torch.bfloat16", "torch.float32"],
    "amp": ["torch.float16", "torch.float32"],
    "fp32": ["torch.float32"],
    "pure_bf16": ["torch.bfloat16"],
}


@pytest.mark.parametrize("precision", DTYPES)
def test_a_world_of_one_trains_as_fsdp2_does_without_it(precision):
    """Four steps of two micro-batches each: the same losses and weights, bit for bit, as FSDP2 at a
    world of one (fp32 weights in the state dict under a mixed precision), from plain parameters."""
    overrides = {"engine.precision": precision, "optim.accum_freq": 2}
    plain = spawn(train_worker, 1, overrides, False)[0]
    fsdp2 = spawn(train_worker, 1, overrides, True)[0]
    assert fsdp2["dtensors"] and not plain["dtensors"]
    assert plain["dtypes"] == DTYPES[precision]
    assert plain["losses"][-1] < plain["losses"][0]
    assert plain["losses"] == fsdp2["losses"]
    for name, value in fsdp2["weights"].items():
        got = plain["weights"][name]
        assert got.dtype == value.dtype and torch.equal(got, value), name


def full_optimizer_state(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every moment and step count the checkpoint holds, gathered whole."""
    state = engine.checkpoint_state()["optim"].state_dict()["optimizer"]["state"]
    return {
        f"{name}.{key}": (value.full_tensor() if isinstance(value, DTensor) else value).clone()
        for name, entry in state.items()
        for key, value in entry.items()
    }


def resume_worker(rank: int, world: int, root: str, save: bool) -> dict:
    """Train two steps and save (`save`), or load what the other world size saved; then the state
    gathered whole, and the losses of two more steps."""
    cfg, engine = engine_at(rank, world, {"engine.precision": "amp_bf16"})
    if save:
        run_steps(engine, cfg, range(2), BATCH)
        dcp.save(engine.checkpoint_state(), checkpoint_id=root)
    else:
        dcp.load(engine.checkpoint_state(), checkpoint_id=root)
    state = {"weights": engine.full_state_dict(), "optimizer": full_optimizer_state(engine)}
    return {**state, "losses": run_steps(engine, cfg, range(2, 4), BATCH)}


@pytest.mark.parametrize("saved_on, resumed_on", [(1, 2), (2, 1)])
def test_a_checkpoint_moves_between_a_world_of_one_and_fsdp2(tmp_path, saved_on, resumed_on):
    """Saved from fp32 masters at a world of one and loaded into FSDP2's shards on two ranks, and
    back: every weight and moment bit for bit what was saved, and the next losses the same (to
    bf16's rounding of two ranks' sums)."""
    root = str(tmp_path / "ckpt")
    saved = spawn(resume_worker, saved_on, root, True)[0]
    resumed = spawn(resume_worker, resumed_on, root, False)[0]
    for part in ("weights", "optimizer"):
        assert resumed[part].keys() == saved[part].keys()
        for name, value in saved[part].items():
            got = resumed[part][name]
            assert got.dtype == value.dtype and torch.equal(got, value), name
    assert all(v.dtype == torch.float32 for v in saved["weights"].values())
    assert resumed["losses"] == pytest.approx(saved["losses"], rel=1e-2)
