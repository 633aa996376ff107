"""Locked towers (--lock-image*, --lock-text*): OpenCLIP's groups, frozen weights that never move
and hold no optimizer state under FSDP2 and ZeRO-1/3, and resume at another world size.

The dist tests run every engine in one spawned world of 2 ranks (DeepSpeed's start-up dominates),
save a DCP checkpoint after a few steps, and load it in a world of 3.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_harness import whole_checkpoint
from support.engine_harness import assert_same_weights, global_batch, make_engine, run_steps
from support.openclip_ref import open_clip_clip
from test_engine_deepspeed import config
from test_engine_deepspeed_checkpoint import AFTER, BATCH, BEFORE, save_and_continue

from bigclip.checkpoint import CheckpointStore
from bigclip.cli_args import parse_train_args
from bigclip.config import TrainConfig
from bigclip.distributed import spawn
from bigclip.engines.optimizer import make_optimizer, param_groups
from bigclip.errors import ConfigError, StorageError
from bigclip.models.clip import MAX_LOGIT_SCALE
from bigclip.models.factory import create_model
from bigclip.models.lock import lock_image_tower, lock_text_tower
from bigclip.ops.loss.contrastive import build_loss

# Image tower: the last block with ln_post, and proj, train; text tower fully locked except its
# LayerNorms (no --lock-text-freeze-layer-norm).
LOCKS = {"model.lock_image": True, "model.lock_image_unlocked_groups": 2, "model.lock_text": True}


def trainable(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("unlocked", [0, 1, 2, 3, 4, 9])
def test_lock_groups_are_open_clips(unlocked):
    ours, theirs = create_model("tiny", device="meta"), open_clip_clip("tiny")
    lock_image_tower(ours, unlocked_groups=unlocked)
    theirs.lock_image_tower(unlocked_groups=unlocked)
    assert trainable(ours) == trainable(theirs)
    ours, theirs = create_model("tiny", device="meta"), open_clip_clip("tiny")
    lock_text_tower(ours, unlocked_layers=unlocked, freeze_layer_norm=True)
    theirs.lock_text_tower(unlocked_layers=unlocked, freeze_layer_norm=True)
    assert trainable(ours) == trainable(theirs)


def test_text_layer_norms_stay_trainable_unless_frozen():
    model = create_model("tiny", device="meta")
    lock_text_tower(model, unlocked_layers=1)  # only text_projection's group unlocked
    text = {n for n in trainable(model) if not n.startswith(("visual.", "logit_"))}
    norms = {
        f"transformer.resblocks.{i}.ln_{j}.{w}" for i in (0, 1) for j in (1, 2) for w in ("weight", "bias")
    }
    assert text == {"text_projection", "ln_final.weight", "ln_final.bias"} | norms


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lock-image-unlocked-groups", "2"], "only with --lock-image"),
        (["--lock-text-unlocked-layers", "1"], "only with --lock-text"),
        (["--lock-text-freeze-layer-norm"], "only with --lock-text"),
        (["--lock-text", "--lock-text-unlocked-layers", "-1"], "must be 0 or more"),
    ],
)
def test_lock_options_that_cannot_apply_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_train_args(["--model", "tiny", *flags])


def reference(cfg: TrainConfig, steps: int) -> dict:
    """The unsharded run: torch AdamW over the trainable parameters only."""
    model = create_model("tiny", device="cpu", seed=cfg.optim.seed)
    lock_image_tower(model, unlocked_groups=cfg.model.lock_image_unlocked_groups)
    lock_text_tower(model)
    optimizer = make_optimizer(param_groups(model, weight_decay=cfg.optim.wd), cfg.optim)
    loss_fn = build_loss(cfg.loss)
    for step in range(steps):
        out = model(*global_batch(step, BATCH))
        loss_fn(out["image_features"], out["text_features"], out["logit_scale"]).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.logit_scale.clamp_(0, MAX_LOGIT_SCALE)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def resume_and_continue(rank: int, world: int, plan: list[tuple[dict, int]], root: str) -> list[dict]:
    out = []
    for c, i in plan:
        cfg = TrainConfig.from_dict(c).validate()
        engine = make_engine(rank, world, cfg)
        dcp.load(engine.checkpoint_state(), checkpoint_id=f"{root}/{i}/saved")
        losses = run_steps(engine, cfg, range(BEFORE, BEFORE + AFTER), BATCH)
        out.append({"losses": losses, "weights": engine.full_state_dict()})
    return out


ENGINES = ("fsdp", "zero1", "zero3")


@pytest.mark.dist
def test_frozen_weights_never_move_and_resume_at_another_world_size(tmp_path):
    cfgs = [config(e, **LOCKS) for e in ENGINES]
    runs = spawn(save_and_continue, 2, cfgs, str(tmp_path))[0]
    initial = create_model("tiny", device="cpu", seed=0).state_dict()
    expected = reference(TrainConfig.from_dict(cfgs[0]), BEFORE + AFTER)
    frozen = {n for n, v in expected.items() if torch.equal(v, initial[n])}
    assert "visual.conv1.weight" in frozen and "transformer.resblocks.1.mlp.c_fc.weight" in frozen
    assert "transformer.resblocks.0.ln_1.weight" not in frozen and "visual.proj" not in frozen
    for engine, run in zip(ENGINES, runs):
        for name in frozen:
            assert torch.equal(run["weights"][name], initial[name]), (engine, name)
        assert_same_weights(expected, run["weights"], rtol=1e-4)
        saved = whole_checkpoint(tmp_path / str(ENGINES.index(engine)) / "saved")
        moments = {k.split(".state.")[1].rsplit(".", 1)[0] for k in saved if k.endswith(".exp_avg")}
        assert moments == set(expected) - frozen, engine  # no optimizer state for frozen weights
        assert {k.removeprefix("model.") for k in saved if k.startswith("model.")} == set(expected)
    # Resume at 3 ranks: the same engine, and across engines (ZeRO-3's checkpoint under FSDP2).
    plan = [(cfgs[i], i) for i in range(len(ENGINES))] + [(cfgs[0], 2)]
    resumed = spawn(resume_and_continue, 3, plan, str(tmp_path))[0]
    for (_, source), run in zip(plan, resumed):
        original = runs[source]
        assert run["losses"] == pytest.approx(original["losses"], rel=1e-4)
        assert_same_weights(original["weights"], run["weights"], rtol=1e-4)
        for name in frozen:
            assert torch.equal(run["weights"][name], initial[name]), name


def locked_then_unlocked(rank: int, world: int, root: str) -> str:
    """Worker: save a locked engine's checkpoint, load it into an unlocked one; the error."""
    locked = make_engine(rank, world, TrainConfig.from_dict(config("fsdp", **LOCKS)).validate())
    store = CheckpointStore(root)
    store.save(locked.checkpoint_state(), step=1, meta={"model": "tiny"})
    unlocked = make_engine(rank, world, TrainConfig.from_dict(config("fsdp")).validate())
    try:
        store.load(unlocked.checkpoint_state())
    except StorageError as e:
        return str(e)
    finally:
        store.close()
    return ""


@pytest.mark.dist
def test_resuming_with_other_locks_says_so(tmp_path):
    message = spawn(locked_then_unlocked, 1, str(tmp_path))[0]
    assert "they were frozen (--lock-image/--lock-text) when it was saved" in message
