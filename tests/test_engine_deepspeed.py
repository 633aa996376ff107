"""DeepSpeed ZeRO engine: every stage trains exactly like an unsharded model and like FSDP2.

The reference is a plain single-process loop (torch AdamW on an unsharded model, full global
batch). Each spawned world runs several engines back to back (DeepSpeed's start-up dominates
the cost), with the real files in ds_configs/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support.engine_harness import assert_same_weights, global_batch, make_engine, run_steps, tiny_config

from bigclip.config import TrainConfig
from bigclip.distributed import spawn
from bigclip.engines.optimizer import make_optimizer, param_groups
from bigclip.models.clip import MAX_LOGIT_SCALE
from bigclip.models.factory import create_model
from bigclip.ops.loss.contrastive import build_loss

os.environ["DS_ACCELERATOR"] = "cpu"  # CPU tests: spawned ranks inherit it before importing DeepSpeed
DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
STAGES = ("zero1", "zero2", "zero3", "zero3_offload")
STEPS, BATCH = 10, 8

pytestmark = pytest.mark.dist


def config(engine: str, **overrides: object) -> dict:
    """A tiny fp32 run on `engine`: 'fsdp' or a ds_configs/ file name."""
    if engine != "fsdp":
        overrides |= {
            "engine.engine": "deepspeed",
            "engine.deepspeed_config": str(DS_CONFIGS / f"{engine}.json"),
        }
    return tiny_config(**overrides).to_dict()


def train(rank: int, world: int, cfg: TrainConfig, steps: int, batch: int) -> dict:
    engine = make_engine(rank, world, cfg)
    losses = run_steps(engine, cfg, range(steps), batch)
    weights = engine.full_state_dict()
    return {"losses": losses, "weights": weights if rank == 0 else None}


def train_all(rank: int, world: int, cfg_dicts: list[dict], steps: int, batch: int) -> list[dict]:
    """Worker: one run per config, in order, in the same processes."""
    return [train(rank, world, TrainConfig.from_dict(c).validate(), steps, batch) for c in cfg_dicts]


def reference(cfg: TrainConfig, steps: int, batch: int) -> dict:
    """The unsharded single-process run every engine must reproduce."""
    model = create_model(cfg.model.model, device="cpu", seed=cfg.optim.seed)
    optimizer = make_optimizer(param_groups(model, weight_decay=cfg.optim.wd), cfg.optim)
    loss_fn = build_loss(cfg.loss)
    losses = []
    for step in range(steps):
        out = model(*global_batch(step, batch))
        loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.logit_scale.clamp_(0, MAX_LOGIT_SCALE)
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def assert_same_run(a: dict, b: dict, *, rtol: float = 1e-4) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=rtol)
    assert_same_weights(a["weights"], b["weights"], rtol=rtol)


@pytest.fixture(scope="module")
def unsharded() -> dict:
    return reference(TrainConfig.from_dict(config("fsdp")).validate(), STEPS, BATCH)


def test_every_zero_stage_matches_unsharded_reference_and_fsdp(unsharded, tmp_path):
    # One more run where DeepSpeed builds the optimizer from an "optimizer" section filled from
    # bigclip's flags (torch's AdamW: DeepSpeedCPUAdam would need its C++ op built).
    ds_optimizer = json.loads((DS_CONFIGS / "zero2.json").read_text())
    ds_optimizer["optimizer"] = {"type": "AdamW", "params": {"torch_adam": True}}
    (tmp_path / "zero2_ds_optimizer.json").write_text(json.dumps(ds_optimizer))
    built = tiny_config(
        **{"engine.engine": "deepspeed", "engine.deepspeed_config": str(tmp_path / "zero2_ds_optimizer.json")}
    )
    cfgs = [config("fsdp"), *map(config, STAGES), built.to_dict()]
    runs = spawn(train_all, 2, cfgs, STEPS, BATCH)[0]
    fsdp, stages = runs[0], dict(zip([*STAGES, "zero2 + DeepSpeed's optimizer"], runs[1:]))
    assert unsharded["losses"][-1] < 0.9 * unsharded["losses"][0]  # it trains
    assert_same_run(unsharded, fsdp)
    for run in stages.values():
        assert_same_run(unsharded, run)
        assert_same_run(fsdp, run)


def test_accumulation_patch_dropout_and_grad_checkpointing_under_both_engines():
    """--accum-freq 2 equals the large batch under every engine; patch dropout and gradient
    checkpointing (with accumulation) give the same run under FSDP2 and ZeRO-3, and so does
    checkpointing with a locked tower (frozen parameters inside checkpointed blocks: DeepSpeed
    0.18.3's ZeRO-3 released them under the recompute, see skip_recompute_check)."""
    accum = {"optim.accum_freq": 2}
    features = accum | {"model.force_patch_dropout": 0.5, "model.grad_checkpointing": True}
    locked = {"model.grad_checkpointing": True, "model.lock_text": True}
    engines = ("fsdp", "zero1", "zero2", "zero3")
    cfgs = [config(e, **accum) for e in engines] + [config(e, **features) for e in ("fsdp", "zero3")]
    cfgs += [config(e, **locked) for e in ("fsdp", "zero3")]
    runs = spawn(train_all, 2, cfgs, 6, BATCH)[0]
    large_batch = reference(TrainConfig.from_dict(config("fsdp")).validate(), 6, BATCH)
    for run in runs[: len(engines)]:
        assert_same_run(large_batch, run)
    fsdp, zero3, fsdp_locked, zero3_locked = runs[len(engines) :]
    assert fsdp["losses"] != pytest.approx(large_batch["losses"], rel=1e-3)  # patch dropout is active
    assert_same_run(fsdp, zero3)
    assert_same_run(fsdp_locked, zero3_locked)


def test_mixed_precision_under_both_engines(unsharded):
    """amp_bf16 keeps fp32 master weights, pure_bf16 keeps everything in bf16; both train like
    fp32 to bf16 accuracy under both engines (DeepSpeed's fp16 needs a GPU: refused on CPU)."""
    runs = [("fsdp", "amp_bf16"), ("zero2", "amp_bf16"), ("zero3", "amp_bf16")]
    runs += [("fsdp", "pure_bf16"), ("zero1", "pure_bf16"), ("zero3", "pure_bf16")]
    out = spawn(train_all, 2, [config(e, **{"engine.precision": p}) for e, p in runs], 6, BATCH)[0]
    for (engine, precision), run in zip(runs, out):
        assert run["losses"] == pytest.approx(unsharded["losses"][:6], rel=2e-2), (engine, precision)
        master = torch.float32 if precision == "amp_bf16" else torch.bfloat16
        assert run["weights"]["visual.proj"].dtype == master, (engine, precision)
    assert out[4]["losses"] == pytest.approx(out[3]["losses"], rel=1e-2)  # ZeRO-1 vs FSDP2, pure bf16


@pytest.mark.slow
def test_torchcompile_under_both_engines(unsharded):
    """--torchcompile compiles each residual block (inductor, local gcc on CPU: slow)."""
    runs = spawn(
        train_all, 2, [config(e, **{"model.torchcompile": True}) for e in ("fsdp", "zero3")], 3, BATCH
    )[0]
    for run in runs:
        assert run["losses"] == pytest.approx(unsharded["losses"][:3], rel=1e-4)
