"""A training step makes no host-device synchronisation (issue 24, item 1).

A sync stalls the host until the device drains its queue: the next kernels are launched late
and the device idles (and FSDP2's prefetch is serialised). Reads belong to the logging
interval (trainer.log_step) and checkpoints. Counted here over several steps of the real training
step (train_step: forward, loss, backward, clip, optimizer step) of each engine at world 1,
under amp_bf16 with gradient clipping and the chunked loss (see support/sync_probe.py for what
counts). The first two steps are excluded: the loss checks its inputs in full once (a run with
mismatched ranks fails at its first step) and ZeRO-3 records and cross-checks its parameter
fetch order (a one-off, reading ids back) over its first steps. Allowed, and documented where they are:
  - fp16 (`--precision amp`): the loss scaler reads whether the gradients overflowed;
  - DeepSpeed's own checks inside `engine.step()`, listed in DEEPSPEED_READS: ZeRO-1/2 read
    whether the gradient norm is finite when clipping (once per parameter group), ZeRO-3 once
    per step. bigclip turns DeepSpeed's bf16 overflow check off (deepspeed_config.py).
"""

from __future__ import annotations

import pytest
import torch
from support.engine_harness import global_batch, make_engine, tiny_config
from support.sync_probe import count_syncs

from bigclip.config import TrainConfig
from bigclip.distributed import spawn
from bigclip.errors import NonFiniteLossError
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss, ClipLoss, build_loss
from bigclip.train.trainer import train_step, verify_inputs

STEPS = 3
WARMUP = 2  # the loss's first full check; ZeRO-3 records its parameter-fetch trace (reads ids)
DEEPSPEED_READS = {  # engine -> (file, reads per step) of DeepSpeed's own `is_invalid_grad_norm`
    "zero2": ("deepspeed/runtime/zero/stage_1_and_2.py", 2),  # clipping, per parameter group
    "zero3": ("deepspeed/runtime/zero/stage3.py", 1),
}
ENGINES = {
    "fsdp": {},
    "zero2": {"engine.engine": "deepspeed", "engine.deepspeed_config": "ds_configs/zero2.json"},
    "zero3": {"engine.engine": "deepspeed", "engine.deepspeed_config": "ds_configs/zero3.json"},
}


def sync_worker(rank: int, world: int, cfg_dict: dict) -> dict:
    cfg = TrainConfig.from_dict(cfg_dict).validate()
    engine = make_engine(rank, world, cfg)
    loss_fn = build_loss(cfg.loss)
    k = cfg.optim.accum_freq

    def step(i: int) -> None:
        images, texts = global_batch(i, 8)
        train_step(engine, loss_fn, [(images[j::k], texts[j::k]) for j in range(k)], lr=1e-3)

    for i in range(WARMUP):
        step(i)
    with count_syncs() as events:
        for i in range(WARMUP, WARMUP + STEPS):
            step(i)
    return dict(events)


def run(engine: str, **overrides: object) -> dict:
    cfg = tiny_config(
        **ENGINES[engine],
        **{"engine.precision": "amp_bf16", "optim.grad_clip_norm": 1.0, "loss.loss_chunk_size": 4},
        **overrides,
    )
    return spawn(sync_worker, 1, cfg.to_dict())[0]


def describe(events: dict) -> str:
    return "\n".join(f"{n} x {op} at {site}" for (op, site), n in events.items())


@pytest.mark.dist
@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp_step_never_syncs(accum):
    events = run("fsdp", **{"optim.accum_freq": accum, "model.force_patch_dropout": 0.5})
    assert not events, describe(events)


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_deepspeed_step_syncs_only_inside_deepspeed(engine):
    events = run(engine)
    where, per_step = DEEPSPEED_READS[engine]
    ours = {key: n for key, n in events.items() if where not in key[1]}
    assert not ours, describe(ours)
    reads = sum(n for (op, _), n in events.items() if op == "_local_scalar_dense")
    assert reads <= per_step * STEPS, describe(events)


@pytest.mark.parametrize("loss_cls", [ChunkedContrastiveLoss, ClipLoss])
def test_loss_defers_its_non_finite_check_to_verify(loss_cls):
    g = torch.Generator().manual_seed(0)
    image = torch.nn.functional.normalize(torch.randn(6, 16, generator=g), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(6, 16, generator=g), dim=-1)
    scale = torch.tensor(10.0)
    loss_fn = loss_cls()
    loss_fn(image, text, scale)  # the first call checks in full (and syncs)
    with count_syncs() as events:
        loss_fn(image, text, scale)
        bad = image.clone()
        bad[2, 3] = float("nan")
        loss_fn(bad, text, scale)  # no read here: the step goes on
        loss_fn(image, text, scale)
    assert not events, describe(events)
    with pytest.raises(NonFiniteLossError, match="by step 7: .*image features on rank 0 contain NaN"):
        verify_inputs(loss_fn, step=7)
    verify_inputs(loss_fn, step=8)  # reported once; later steps were finite
    loss_fn(image, text, torch.tensor(float("inf")))
    with pytest.raises(NonFiniteLossError, match="logit scale on rank 0 is inf"):
        loss_fn.verify()
    with pytest.raises(NonFiniteLossError, match="image features on rank 0"):
        loss_fn(bad[:5], text[:5], scale)  # new shapes: checked in full at once
