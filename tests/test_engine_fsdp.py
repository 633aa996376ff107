"""FSDP2 engine: sharded training equals single-rank training on the same global batch."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.engine_harness import (
    assert_same_weights,
    global_batch,
    make_engine,
    run_engine,
    run_steps,
    tiny_config,
)
from torch.distributed.tensor import DTensor

from bigclip.distributed import Runtime, spawn
from bigclip.engines import build_engine
from bigclip.engines.optimizer import LocalShardOptimizer, make_optimizer, param_groups, set_lr
from bigclip.models.factory import create_model
from bigclip.ops.loss.contrastive import build_loss
from bigclip.train.trainer import contrastive_loss, train_step

pytestmark = pytest.mark.dist


# fp32 runs that differ only in summation order (shards, micro-batches) agree to ~1e-7 per step,
# but AdamW divides by sqrt(v): for biases whose gradients are near zero that difference grows
# to ~1.6e-5 after a few steps on some hosts (seen with AVX-512 kernels). 5e-5 is still far below
# what a wrong reduction does (a dropped shard or micro-batch moves weights by 1e-3 or more).
FP32_RTOL = 5e-5


def _assert_same_run(a: dict, b: dict, rtol: float) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=rtol)
    assert_same_weights(a["weights"], b["weights"], rtol=rtol)


def test_two_ranks_match_one_rank_fp32():
    cfg = tiny_config().to_dict()
    one = spawn(run_engine, 1, cfg, 6, 8)[0]
    two = spawn(run_engine, 2, cfg, 6, 8)[0]
    assert one["losses"][-1] < one["losses"][0]  # it trains
    _assert_same_run(one, two, rtol=FP32_RTOL)


def test_initial_weights_equal_unsharded_init():
    weights = spawn(run_engine, 2, tiny_config().to_dict(), 0, 8)[0]["weights"]
    reference = create_model("tiny", device="cpu", seed=0).state_dict()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


def test_accumulation_equals_large_batch():
    """--accum-freq 2 with micro-batch b == one step with batch 2b (fp32)."""
    plain = spawn(run_engine, 2, tiny_config().to_dict(), 4, 8)[0]
    accum = spawn(run_engine, 2, tiny_config(**{"optim.accum_freq": 2}).to_dict(), 4, 8)[0]
    _assert_same_run(plain, accum, rtol=FP32_RTOL)


def gathered_with_the_first_block(rank: int, world: int, per_unit: int) -> list[bool]:
    """Which blocks' parameters are gathered when the first block's forward starts."""
    cfg = tiny_config(**{"engine.fsdp_blocks_per_unit": per_unit})
    engine = make_engine(rank, world, cfg)
    blocks, seen = list(engine.module.blocks()), []

    def look(*_: object) -> None:
        seen.extend(not isinstance(b.mlp.c_fc.weight, DTensor) for b in blocks)

    blocks[0].register_forward_pre_hook(look)
    engine.forward(*global_batch(0, 4))
    return seen


def test_several_blocks_to_a_unit_are_gathered_together_and_train_the_same():
    """--fsdp-blocks-per-unit 3 on tiny's four blocks: the first three (a unit across the towers'
    boundary) are gathered as one, the fourth alone; the run computes what one block a unit does."""
    assert spawn(gathered_with_the_first_block, 2, 3)[0] == [True, True, True, False]
    assert spawn(gathered_with_the_first_block, 2, 1)[0] == [True, False, False, False]
    one = spawn(run_engine, 2, tiny_config().to_dict(), 3, 8)[0]
    three = spawn(run_engine, 2, tiny_config(**{"engine.fsdp_blocks_per_unit": 3}).to_dict(), 3, 8)[0]
    _assert_same_run(one, three, rtol=FP32_RTOL)


CLIP_TO = 0.01  # far below the tiny model's first gradient norm: the step is clipped


def clipped_step(rank: int, world: int, through_engine: bool) -> dict:
    """Two clipped steps on global batches: through FSDP2, or on the plain model with torch's own
    clip_grad_norm_ and the same optimizer (two, since AdamW's first step is blind to a gradient's
    scale). Rank 0 returns the norms and the weights after them."""
    cfg = tiny_config(**{"optim.grad_clip_norm": CLIP_TO})
    loss_fn, batches, norms = build_loss(cfg.loss), [global_batch(step, 8) for step in range(2)], []
    if through_engine:
        engine, local = make_engine(rank, world, cfg), 8 // world
        for images, texts in batches:
            mine = [(images[rank * local : (rank + 1) * local], texts[rank * local : (rank + 1) * local])]
            norms.append(train_step(engine, loss_fn, mine, lr=cfg.optim.lr).stats.grad_norm.item())
        return {"norms": norms, "weights": engine.full_state_dict()}
    model = create_model("tiny", device="cpu", seed=cfg.optim.seed)
    optimizer = make_optimizer(param_groups(model, weight_decay=cfg.optim.wd), cfg.optim)
    set_lr(optimizer, cfg.optim.lr)
    for images, texts in batches:
        contrastive_loss(loss_fn, model(images, texts)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_TO).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_the_gradient_norm_and_its_clipping_are_torchs_over_the_whole_model():
    """FSDP2 on two ranks reports the norm torch's clip_grad_norm_ takes of the unsharded model's
    gradients (sharded parts summed across ranks, the replicated logit scale once) and clips by it."""
    sharded = spawn(clipped_step, 2, True)[0]
    plain = spawn(clipped_step, 1, False)[0]
    assert sharded["norms"] == pytest.approx(plain["norms"], rel=1e-5) and min(plain["norms"]) > 10 * CLIP_TO
    assert_same_weights(sharded["weights"], plain["weights"], rtol=FP32_RTOL)


def fp16_overflow_worker(rank: int, world: int) -> dict:
    cfg = tiny_config(**{"engine.precision": "amp"})
    runtime = Runtime(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    engine = build_engine(cfg, runtime)
    engine.build(create_model("tiny", device="meta"))
    loss_fn = build_loss(cfg.loss)
    images, texts = global_batch(0, 8)
    scales, unchanged = [engine.scaler.scale], []
    loss = contrastive_loss(loss_fn, engine.forward(images, texts))
    engine.backward(loss * 1e30)  # inf once scaled: this step must be skipped
    steps = [engine.step(lr=1e-3)]
    for _ in range(8):  # fp16 may overflow again at the start scale: each overflow halves it
        before = engine.full_state_dict()
        steps.append(train_step(engine, loss_fn, [(images, texts)], lr=1e-3).stats)
        after = engine.full_state_dict()
        unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
        if not steps[-1].skipped:
            break
    scales += [s.loss_scale for s in steps]
    return {"skipped": [s.skipped for s in steps], "scales": scales, "unchanged": unchanged}


def test_fp16_overflow_skips_the_step_halves_the_scale_and_recovers():
    """--precision amp (fp16): a step whose gradients overflow changes no weight and halves the
    loss scale (down to where fp16 holds the gradients); the first finite step then trains."""
    result = spawn(fp16_overflow_worker, 2)[0]
    skipped, scales = result["skipped"], result["scales"]
    assert skipped[0] and not skipped[-1], skipped  # forced overflow skipped; training recovered
    for i, was_skipped in enumerate(skipped):
        assert scales[i + 1] == (scales[i] / 2 if was_skipped else scales[i]), scales
    assert result["unchanged"][:-1] == [True] * (len(skipped) - 2) and not result["unchanged"][-1]


def foreach_checkpoint_worker(rank: int, world: int, root: str) -> dict:
    """A checkpoint written by a run whose engine stepped foreach AdamW (bigclip before it switched
    to fused), then resumed by today's engine."""
    cfg, batch = tiny_config(), 8
    old = make_engine(rank, world, cfg)
    foreach = tiny_config(**{"optim.opt_kwargs": {"foreach": True, "fused": False}}).optim
    old.optimizer = LocalShardOptimizer(param_groups(old.module, weight_decay=foreach.wd), foreach)
    run_steps(old, cfg, range(3), batch)
    dcp.save(old.checkpoint_state(), checkpoint_id=root)
    old_losses = run_steps(old, cfg, range(3, 6), batch)
    new = make_engine(rank, world, cfg)
    dcp.load(new.checkpoint_state(), checkpoint_id=root)
    kernels = [(g["fused"], g["foreach"]) for g in new.optimizer.param_groups]
    new_losses = run_steps(new, cfg, range(3, 6), batch)
    return {"kernels": kernels, "losses": (old_losses, new_losses),
            "weights": (old.full_state_dict(), new.full_state_dict())}  # fmt: skip


def test_a_checkpoint_of_foreach_adamw_resumes_with_the_fused_kernel(tmp_path):
    result = spawn(foreach_checkpoint_worker, 2, str(tmp_path / "ckpt"))[0]
    assert result["kernels"] == [(True, None), (True, None)]
    old, new = result["losses"]
    assert new == pytest.approx(old, rel=FP32_RTOL)
    assert_same_weights(*result["weights"], rtol=FP32_RTOL)


def amsgrad_worker(rank: int, world: int, root: str) -> dict:
    """AMSGrad (--opt-kwargs amsgrad=True) on local shards, checkpointed and resumed by a fresh engine."""
    cfg, batch = tiny_config(**{"optim.opt_kwargs": {"amsgrad": True}}), 8
    ours = make_engine(rank, world, cfg)
    run_steps(ours, cfg, range(3), batch)
    dcp.save(ours.checkpoint_state(), checkpoint_id=root)
    keys = sorted(dcp.FileSystemReader(root).read_metadata().state_dict_metadata)
    straight = run_steps(ours, cfg, range(3, 6), batch)
    resumed = make_engine(rank, world, cfg)
    dcp.load(resumed.checkpoint_state(), checkpoint_id=root)
    return {"keys": keys, "resumed": (straight, run_steps(resumed, cfg, range(3, 6), batch)),
            "weights": (ours.full_state_dict(), resumed.full_state_dict())}  # fmt: skip


def test_an_amsgrad_checkpoint_holds_its_extra_moment_and_resumes_the_same_run(tmp_path):
    result = spawn(amsgrad_worker, 2, str(tmp_path / "ckpt"))[0]
    assert any(k.endswith(".max_exp_avg_sq") for k in result["keys"]), result["keys"][:5]
    straight, resumed = result["resumed"]
    assert resumed == pytest.approx(straight, rel=FP32_RTOL)
    assert_same_weights(*result["weights"], rtol=FP32_RTOL)
