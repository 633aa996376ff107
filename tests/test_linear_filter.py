"""--linear-filter: a low-precision kind converts only the linears its measured shape table says
are faster than bf16 on the run's GPU family (config/linear_speedups.py), and the run's log line
says which it converted and why. A CPU can read a GPU family's table (fp8 emulated, int8 through
torch's matmuls): there a small linear stays 16-bit, and the model computes what the plain one does."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from bigclip.cli_args import parse_train_args
from bigclip.config import linear_speedups
from bigclip.config.linear_speedups import SPEEDUPS, Measured, device_family, linear_filter
from bigclip.models.from_config import build_model
from bigclip.ops.int8.switchback import SwitchBackLinear

GPU_RESULTS = Path(__file__).parents[1] / "benchmarks" / "results" / "switchback_layers_gpu.json"
BIGG_FC1 = (1664, 8192)  # ViT-bigG-14's visual mlp.c_fc


def test_a_linear_converts_only_where_a_shape_it_dominates_was_measured_faster():
    at_batch_256, at_batch_64 = 256 * 257, 64 * 257  # bigG's visual tokens per micro-batch
    fast = linear_filter("switchback-vectorwise", "hopper", *BIGG_FC1, at_batch_256)
    assert fast.convert and fast.reason == "1664->8192 at 65536 tokens measured 1.02x"
    slow = linear_filter("switchback-vectorwise", "hopper", *BIGG_FC1, at_batch_64)  # 0.86x at 16384 tokens
    assert (
        not slow.convert and slow.reason == "no shape at most this large measured faster than bf16 on hopper"
    )
    assert not linear_filter("switchback-global", "hopper", *BIGG_FC1, 10**7).convert  # never measured faster
    assert linear_filter("fp8-rowwise", "hopper", 8192, 8192, 16384).convert  # torchao: 1.30x
    assert not linear_filter("fp8-rowwise", "hopper", 8192, 2048, 16384).convert  # 0.87x
    assert not linear_filter("fp8-rowwise", "hopper", *BIGG_FC1, 10**7).convert  # K 1664 < any faster row's


def test_where_nothing_was_measured_every_linear_converts_and_the_reason_says_why():
    for family, why in (
        ("ampere", "no measured shapes for fp8-rowwise on ampere GPUs"),
        ("unknown", "no measured shapes for fp8-rowwise on unknown GPUs"),
        ("cpu", "a CPU runs the kinds for their numerics, not speed"),
        ("all", "--linear-filter all"),
    ):
        assert linear_filter("fp8-rowwise", family, 64, 64, 1) == linear_speedups.Decision(
            True, f"every linear: {why}"
        )
    assert (device_family("cuda", (9, 0)), device_family("cuda", (7, 5)), device_family("cpu")) == (
        "hopper",
        "unknown",
        "cpu",
    )


def test_the_switchback_rows_are_what_the_gpu_benchmark_measured():
    kinds = {"global", "vectorwise", "memefficient"}
    rows = json.loads(GPU_RESULTS.read_text())["rows"]
    measured = {
        (f"switchback-{r['variant']}", r["shape"], r["tokens"]): r["speedup"]
        for r in rows
        if r["variant"] in kinds
    }
    table = {
        (kind, f"{m.in_features}->{m.out_features}", m.tokens): m.speedup
        for (kind, family), ms in SPEEDUPS.items()
        if kind.startswith("switchback") and family == "hopper"
        for m in ms
    }
    assert table == measured


def build(kind: str, *extra: str, caplog: pytest.LogCaptureFixture) -> tuple[nn.Module, str]:
    from bigclip.models import from_config

    from_config._said.clear()  # one line per process: this test reads each build's
    argv = ["--model", "tiny", "--train-data", "x/{0..1}.tar", "--precision", "fp32", "--linear-kind", kind]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bigclip.models"):
        model = build_model(parse_train_args([*argv, *extra]), device="cpu")
    return model, caplog.text


def block_linears(model: nn.Module, *, attention: bool = True) -> dict[str, nn.Module]:
    """The blocks' nn.Linear slots (of the MLPs only, without `attention`), by name."""
    slots = model.swappable_linears()
    return {
        s.name: getattr(s.parent, s.attr)
        for s in slots
        if s.kind == "linear" and (attention or s.role == "mlp")
    }


@pytest.mark.parametrize("kind", ["switchback-vectorwise", "fp8-rowwise"])
def test_on_a_cpu_hoppers_table_keeps_a_small_model_16_bit_and_says_so(kind, caplog):
    if kind.startswith("fp8"):
        pytest.importorskip("torchao", reason="--linear-kind fp8-* needs torchao (bigclip[fp8])")
    filtered, line = build(kind, "--linear-filter", "hopper", caplog=caplog)
    assert all(type(m) is nn.Linear for m in block_linears(filtered).values())
    assert "0 of " in line and "stay 16-bit: vision mlp.c_fc x2 64->256 at 4160 tokens;" in line
    assert "(no shape at most this large measured faster than bf16 on hopper)" in line
    assert "the kind changes nothing here: --linear-kind none is the same step" in line
    plain, _ = build("none", caplog=caplog)
    plain.load_state_dict(filtered.state_dict())
    images, texts = torch.randn(2, 3, 64, 64), torch.randint(1, 1000, (2, 32))
    assert torch.equal(filtered(images, texts)["image_features"], plain(images, texts)["image_features"])
    unfiltered, line = build(kind, caplog=caplog)  # auto on a CPU: every linear, for its numerics
    swapped = block_linears(unfiltered, attention=kind.startswith("fp8"))  # SwitchBack: MLPs by default
    assert all(type(m) is not nn.Linear for m in swapped.values())
    assert "converted (every linear: a CPU runs the kinds for their numerics, not speed)" in line


def test_a_measured_faster_shape_converts_those_linears_only_and_they_train(monkeypatch, caplog):
    """A row the tiny model's visual fc1 dominates (64->256 at 4096 tokens, 1.2x): its two visual
    fc1s are SwitchBack, every other linear stays nn.Linear, and a step trains both kinds."""
    row = Measured(64, 256, 4096, 1.2, "this test")
    monkeypatch.setitem(SPEEDUPS, ("switchback-vectorwise", "hopper"), (row,))
    model, line = build("switchback-vectorwise", "--linear-filter", "hopper", caplog=caplog)
    converted = sorted(name for name, m in block_linears(model).items() if isinstance(m, SwitchBackLinear))
    assert converted == ["visual.transformer.resblocks.0.mlp.c_fc", "visual.transformer.resblocks.1.mlp.c_fc"]
    assert (
        "2 of 8 MLP linears (attention stays 16-bit) converted: vision mlp.c_fc x2 64->256 at 4160 tokens "
        "(64->256 at 4096 tokens measured 1.20x); 6 stay 16-bit: vision mlp.c_proj x2 256->64 at 4160 tokens; "
        "text mlp.c_fc x2 64->256 at 2048 tokens; text mlp.c_proj x2 256->64 at 2048 tokens (no shape at most "
        "this large measured faster than bf16 on hopper)"
    ) in line
    images, texts = torch.randn(2, 3, 64, 64), torch.randint(1, 1000, (2, 32))
    out = model(images, texts)
    (out["image_features"].sum() + out["text_features"].sum()).backward()
    fc1 = model.visual.transformer.resblocks[0].mlp.c_fc
    assert fc1.weight.grad is not None and fc1.weight.grad.abs().sum() > 0


def test_the_planner_prices_int8_saved_inputs_only_where_the_kind_converts():
    """switchback-memefficient saves its linears' inputs as int8, but on Hopper no shape was
    measured faster, so --linear-filter auto (the planned H100's) leaves them 16-bit: the plan
    holds what a plain model holds. With --linear-filter all it prices the int8 copies."""
    from bigclip.plan.memory import activation_bytes
    from bigclip.plan.spec import PlanSpec

    plain = PlanSpec(model="ViT-bigG-14", gpus=8, batch_size=64)
    filtered = dataclasses.replace(plain, linear_kind="switchback-memefficient")
    every = dataclasses.replace(filtered, linear_filter="all")
    assert activation_bytes(filtered) == activation_bytes(plain)
    assert activation_bytes(every) < activation_bytes(plain)
