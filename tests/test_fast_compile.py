"""--torchcompile compiles every residual block whole: no graph breaks (issue 24, item 1).

A graph break splits a block into several compiled graphs with eager Python between them:
each break costs a launch gap and stops the compiler fusing across it. Checked two ways:
  - dynamo's explain on each block of both towers (vision: no mask; text: causal), with and
    without patch dropout (which changes the vision blocks' sequence length), with each
    SwitchBack variant swapped into the MLP and attention projections, in fp32 and in bf16
    (the dtype the engines run blocks in under amp_bf16); and on the whole model's forward;
  - the real training step of each engine with --torchcompile, counting dynamo's
    `graph_break` counter over two steps (forward and backward). The blocks compile with the
    aot_eager backend there: graph breaks are decided by dynamo's tracing, before any backend
    sees a graph, and inductor's C++ compile takes minutes on a CPU.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch._dynamo as dynamo
from support.engine_harness import global_batch, make_engine, tiny_config
from torch import nn

from bigclip.config import TrainConfig
from bigclip.distributed import spawn
from bigclip.models.factory import create_model
from bigclip.models.vision import kept_patches
from bigclip.ops.int8.switchback import INT8_MODES, apply_int8
from bigclip.ops.loss.contrastive import build_loss
from bigclip.train.trainer import train_step

VARIANTS = ["none", *INT8_MODES]


def tiny_model(*, int8: str, patch_dropout: float, dtype: torch.dtype) -> nn.Module:
    model = create_model("tiny", device="cpu", patch_dropout=patch_dropout)
    if int8 != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tiny widths are multiples of 16: nothing falls back
            apply_int8(model, int8, include_attention=True)
    return model.to(dtype).train()


def block_inputs(model: nn.Module, tower: str, batch: int = 2) -> tuple[list[nn.Module], torch.Tensor, bool]:
    """The blocks of `tower`, an input of the shape they receive in training, and `causal`."""
    dtype = model.logit_scale.dtype
    if tower == "vision":
        v = model.visual
        tokens = kept_patches((v.image_size // v.patch_size) ** 2, v.patch_dropout.prob) + 1
        return (
            list(v.transformer.resblocks),
            torch.randn(batch, tokens, v.transformer.width, dtype=dtype),
            False,
        )
    width = model.transformer.width
    return (
        list(model.transformer.resblocks),
        torch.randn(batch, model.context_length, width, dtype=dtype),
        True,
    )


def explain(fn: object, *args: object) -> object:
    dynamo.reset()
    return dynamo.explain(fn)(*args)


# (tower, patch dropout): patch dropout shortens the vision blocks' sequence; the text tower has none.
TOWERS = [("vision", 0.0), ("vision", 0.5), ("text", 0.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("int8", VARIANTS)
@pytest.mark.parametrize(("tower", "patch_dropout"), TOWERS, ids=["vision", "vision-patch-dropout", "text"])
def test_every_block_is_one_graph(tower, patch_dropout, int8, dtype):
    model = tiny_model(int8=int8, patch_dropout=patch_dropout, dtype=dtype)
    blocks, x, causal = block_inputs(model, tower)
    assert all(type(b) is type(blocks[0]) for b in blocks)  # one class: its first block stands for all
    result = explain(blocks[0], x.requires_grad_(), causal)
    reasons = [str(b.reason) for b in result.break_reasons]
    assert result.graph_break_count == 0 and result.graph_count == 1, reasons


@pytest.mark.parametrize("int8", ["none", "switchback-vectorwise"])
@pytest.mark.parametrize("patch_dropout", [0.0, 0.5], ids=["no-dropout", "patch-dropout"])
def test_whole_model_forward_has_no_graph_breaks(patch_dropout, int8):
    model = tiny_model(int8=int8, patch_dropout=patch_dropout, dtype=torch.float32)
    images, texts = global_batch(0, 2)
    result = explain(model, images, texts)
    assert result.graph_break_count == 0, [str(b.reason) for b in result.break_reasons]


def compiled_step_worker(rank: int, world: int, cfg_dict: dict) -> dict:
    """Two training steps with --torchcompile; dynamo's counters over both."""
    from torch._dynamo.utils import counters

    torch.compile = functools.partial(torch.compile, backend="aot_eager")  # nn.Module.compile calls it too
    cfg = TrainConfig.from_dict(cfg_dict).validate()
    engine = make_engine(rank, world, cfg)
    loss_fn = build_loss(cfg.loss)
    dynamo.reset()
    counters.clear()
    for step in range(2):
        train_step(engine, loss_fn, [global_batch(step, 8)], lr=1e-3)
    breaks = {str(reason): n for reason, n in counters["graph_break"].items()}
    return {"breaks": breaks, "captured": counters["stats"]["calls_captured"]}


ENGINES = {
    "fsdp": {},
    "zero3": {"engine.engine": "deepspeed", "engine.deepspeed_config": "ds_configs/zero3.json"},
}


@pytest.mark.dist
@pytest.mark.parametrize(
    ("engine", "int8"), [("fsdp", "switchback-vectorwise"), ("zero3", "none")], ids=["fsdp-int8", "zero3"]
)
def test_compiled_training_step_has_no_graph_breaks(engine, int8):
    cfg = tiny_config(
        **ENGINES[engine],
        **{
            "engine.precision": "amp_bf16",
            "model.torchcompile": True,
            "model.force_patch_dropout": 0.5,
            "model.linear_kind": int8,
            "model.int8_attention": int8 != "none",
        },
    )
    result = spawn(compiled_step_worker, 1, cfg.to_dict())[0]
    assert result["captured"] > 0, "no block was compiled"
    assert result["breaks"] == {}
