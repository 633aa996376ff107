"""Under amp_bf16 every activation inside a residual block is bf16 (issue 24, item 1).

An fp32 activation doubles its memory and bandwidth and runs its matmuls at a fraction of the
tensor cores' rate. The only fp32 outputs allowed are those numerics need and kernels produce
by design: LayerNorm's per-token statistics, the attention kernel's log-sum-exp, SwitchBack's
per-row scales (support/dtype_probe.py). Checked on the real engines' block forwards in a
training step: FSDP2 (its MixedPrecisionPolicy casts block parameters and inputs to bf16) and
DeepSpeed ZeRO-3 (bf16 runs the module in bf16). Each block's attention must also reach the
fused SDPA kernel (flash on CPU and GPU): same-dtype q/k/v with a contiguous last dimension,
a supported head size, and no explicit mask (causal by flag in the text tower).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.dtype_probe import record_block_ops
from support.engine_harness import global_batch, make_engine, tiny_config

from bigclip.config import TrainConfig
from bigclip.distributed import spawn
from bigclip.ops.loss.contrastive import build_loss
from bigclip.train.trainer import train_step

ENGINES = {
    "fsdp": {},
    "zero3": {"engine.engine": "deepspeed", "engine.deepspeed_config": "ds_configs/zero3.json"},
}
FLASH = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention")


def dtype_worker(rank: int, world: int, cfg_dict: dict) -> dict:
    cfg = TrainConfig.from_dict(cfg_dict).validate()
    engine = make_engine(rank, world, cfg)
    blocks = engine.unwrapped().blocks()
    with record_block_ops(blocks) as record:
        train_step(engine, build_loss(cfg.loss), [global_batch(0, 4)], lr=1e-3)
    return {"blocks": len(blocks), **dataclasses.asdict(record)}


@pytest.mark.dist
@pytest.mark.parametrize(
    ("engine", "int8"),
    [("fsdp", "none"), ("fsdp", "switchback-global"), ("zero3", "none")],
    ids=["fsdp", "fsdp-int8", "zero3"],
)
def test_block_activations_are_bf16_and_attention_is_fused(engine, int8):
    cfg = tiny_config(
        **ENGINES[engine],
        **{
            "engine.precision": "amp_bf16",
            "model.force_patch_dropout": 0.5,
            "model.linear_kind": int8,
            "model.int8_attention": int8 != "none",
        },
    )
    record = spawn(dtype_worker, 1, cfg.to_dict())[0]
    assert record["ops"] > 0, "no op ran inside a block"
    assert record["fp32"] == [], "fp32 activations inside blocks:\n" + "\n".join(record["fp32"])
    calls = record["sdpa"]
    assert len(calls) == record["blocks"], calls  # one fused attention per block, none decomposed
    for call in calls:
        assert call["op"] in FLASH and not call["has_mask"], call
        assert call["dtypes"] == (torch.bfloat16,) * 3 and call["last_dim_contiguous"], call
        assert call["head_dim"] % 8 == 0 and call["head_dim"] <= 256, call
