"""Every precision x activation checkpointing x engine trains, and checkpointing changes no loss.

The table the GPU stack broke: on torch < 2.13, FSDP2 amp_bf16 with --grad-checkpointing crashed in
the first backward ("mat1 and mat2 must have the same dtype, Float and BFloat16": the recompute of
a checkpoint taken around an FSDP2 unit skipped its input cast). The checkpoint now sits inside
each block (bigclip.models.activation_checkpointing), and this file runs on both CI stacks (torch 2.11 and the
default): each engine trains 2 steps at every precision with and without checkpointing, and the
checkpointed losses equal the plain ones bit for bit (recomputation on CPU is deterministic).
Where this CPU lacks fp16 (support/machine.py asks DeepSpeed's accelerator), ZeRO's fp16 rows must
be refused with bigclip's one line instead; they are also run with fp16 withheld on every machine.

A precision also means the same on both engines: amp_bf16's losses under FSDP2 and ZeRO agree to
a tolerance set by the one thing DeepSpeed's bf16 mode rounds that FSDP2 keeps in fp32 (the logit
scale's working copy; see docs/engines-and-precision.md "Precision").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.engine_harness import global_batch, make_engine, run_steps, tiny_config
from support.machine import WITHHOLD_FP16_ENV, ZERO_FP16_REFUSAL, expected_refusal

from bigclip.config import PRECISIONS, TrainConfig
from bigclip.distributed import spawn

os.environ["DS_ACCELERATOR"] = "cpu"  # spawned ranks inherit it before importing DeepSpeed
DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
ENGINES = ("fsdp", "zero1", "zero2", "zero3")
# (label, model overrides): no checkpointing, then the checkpointing settings that must not change a loss.
CHECKPOINTING = {
    "off": {},
    "full": {"model.grad_checkpointing": True},
    "every-2": {"model.grad_checkpointing": True, "model.grad_checkpointing_every": 2},
    "ops": {"model.grad_checkpointing": True, "model.grad_checkpointing_policy": "ops"},
}
STEPS, BATCH = 2, 8

pytestmark = pytest.mark.dist


def engine_config(engine: str, precision: str, **overrides: object) -> TrainConfig:
    if engine != "fsdp":
        overrides |= {
            "engine.engine": "deepspeed",
            "engine.deepspeed_config": str(DS_CONFIGS / f"{engine}.json"),
        }
    return tiny_config(**{"engine.precision": precision, **overrides})


def train_table(
    rank: int, world: int, engine: str, precisions: tuple[str, ...] = PRECISIONS
) -> dict[tuple[str, str], object]:
    """Worker: every precision x checkpointing setting of one engine, back to back in one process;
    also the dtype of the features each precision's forward returns. A setting that raises has
    its error as its result, and the rest of the table goes on."""
    table: dict[tuple[str, str], object] = {}
    for precision in precisions:
        engine_ = None
        for label, overrides in CHECKPOINTING.items():
            try:
                cfg = engine_config(engine, precision, **overrides)
                engine_ = make_engine(rank, world, cfg)
                table[precision, label] = run_steps(engine_, cfg, range(STEPS), BATCH)
            except Exception as e:  # noqa: BLE001 (judged per row by the tests)
                table[precision, label], engine_ = f"{type(e).__name__}: {e}", None
        if engine_ is not None:
            table[precision, "features"] = str(engine_.forward(*global_batch(0, 2))["image_features"].dtype)
    return table


@pytest.fixture(scope="module")
def table() -> dict[str, dict[tuple[str, str], object] | Exception]:
    tables: dict[str, dict[tuple[str, str], object] | Exception] = {}
    for engine in ENGINES:  # a process that dies fails its engine's tests, not the module
        try:
            tables[engine] = spawn(train_table, 1, engine)[0]
        except RuntimeError as e:
            tables[engine] = e
    return tables


def runs_of(table: dict, engine: str) -> dict[tuple[str, str], object]:
    if isinstance(table[engine], Exception):
        pytest.fail(f"{engine}: the table's process failed: {table[engine]}")
    return table[engine]


def check_precision(runs: dict, engine: str, precision: str, *, refusal: str | None) -> None:
    """`refusal`: the fragment of the ConfigError this machine must answer with, or None where
    every checkpointing setting must train and give the plain run's losses bit for bit."""
    if refusal is not None:
        for label in CHECKPOINTING:
            result = runs[precision, label]
            assert isinstance(result, str) and result.startswith("ConfigError") and refusal in result, (
                f"{engine} {precision} '{label}': expected the refusal ({refusal}), got {result}"
            )
        return
    plain = runs[precision, "off"]
    assert isinstance(plain, list) and len(plain) == STEPS, f"{engine} {precision}: {plain}"
    assert all(loss == loss and loss > 0 for loss in plain), plain  # trained, finite
    for label in CHECKPOINTING:
        assert runs[precision, label] == plain, (
            f"{engine} {precision}: checkpointing '{label}' changed the losses"
        )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpointing_changes_no_loss(table: dict, engine: str, precision: str) -> None:
    check_precision(runs_of(table, engine), engine, precision, refusal=expected_refusal(engine, precision))


def test_fp16_rows_as_on_a_cpu_without_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's expectations follow the machine: with fp16 withheld (as on an AMD EPYC), ZeRO's
    fp16 rows are refused with the one line, whatever this CPU offers."""
    monkeypatch.setenv(WITHHOLD_FP16_ENV, "1")
    runs = spawn(train_table, 1, "zero2", ("amp",))[0]
    check_precision(runs, "zero2", "amp", refusal=ZERO_FP16_REFUSAL)


@pytest.mark.parametrize("engine", ("zero1", "zero2", "zero3"))
def test_amp_bf16_means_the_same_on_both_engines(table: dict, engine: str) -> None:
    table = {e: runs_of(table, e) for e in ("fsdp", engine)}
    fsdp, zero = table["fsdp"]["amp_bf16", "off"], table[engine]["amp_bf16", "off"]
    # Every module computes in bf16 under both (FSDP2 used to keep its root, embeddings and
    # projections, in fp32: its features came out fp32 and its first loss 2.4e-3 away from ZeRO's).
    assert table["fsdp"]["amp_bf16", "features"] == table[engine]["amp_bf16", "features"] == "torch.bfloat16"
    # Same forward from the same fp32 masters but for DeepSpeed's bf16 working copy of the logit
    # scale (<= 0.4% of the temperature): ~1e-3 of the first loss here. Later steps also differ by
    # how each stage accumulates bf16 gradients (ZeRO-2 and ZeRO-3 differ from each other as much).
    assert abs(fsdp[0] - zero[0]) <= 2e-3 * fsdp[0], f"first loss: FSDP2 {fsdp[0]} vs {engine} {zero[0]}"
    assert abs(fsdp[1] - zero[1]) <= 5e-3 * fsdp[1], f"second loss: FSDP2 {fsdp[1]} vs {engine} {zero[1]}"
    # And amp_bf16 is not fp32 under either engine (a policy that silently ran fp32 would pass above).
    assert table["fsdp"]["fp32", "off"][0] != fsdp[0] and table[engine]["fp32", "off"][0] != zero[0]
