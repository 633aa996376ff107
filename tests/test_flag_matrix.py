"""Every flag combination the README tells a GPU user to make trains, on both engines and both CI stacks.

One table, not one test per bug: each row starts from the standard large-run flags (amp_bf16 and
activation checkpointing) and adds what a user combines with them. Each row trains 2 steps of the
tiny model with the real engine (world of one over gloo) and must give finite, decreasing-capable
losses; rows refused where the machine lacks what they need (fp16 on ZeRO without oneDNN fp16:
support/machine.py) must be refused before anything is built, with a message that says what to do. A failure names the row, so a crash like torch 2.11's amp_bf16 +
checkpointing one shows up as one red row here rather than on a GPU.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from support.engine_harness import make_engine, run_steps, tiny_config
from support.machine import WITHHOLD_FP16_ENV, ZERO_FP16_REFUSAL, expected_refusal
from support.stacks import LOW_STACK_ENV

from bigclip.config import TrainConfig
from bigclip.distributed import spawn

os.environ["DS_ACCELERATOR"] = "cpu"  # spawned ranks inherit it before importing DeepSpeed
DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
ENGINES = ("fsdp", "zero2", "zero3")
STANDARD = {"engine.precision": "amp_bf16", "model.grad_checkpointing": True}
ROWS: dict[str, dict[str, object]] = {
    "standard": {},
    "no-checkpointing": {"model.grad_checkpointing": False},
    "selective-checkpointing": {
        "model.grad_checkpointing_policy": "ops",
        "model.grad_checkpointing_every": 2,
    },
    "fp16": {"engine.precision": "amp"},
    "pure-bf16": {"engine.precision": "pure_bf16"},
    "patch-dropout": {"model.force_patch_dropout": 0.5},
    "switchback-global": {"model.linear_kind": "switchback-global"},
    "switchback-vectorwise": {"model.linear_kind": "switchback-vectorwise"},
    "switchback-memefficient-attention": {
        "model.linear_kind": "switchback-memefficient",
        "model.int8_attention": True,
    },
    "fp8-tensorwise": {"model.linear_kind": "fp8-tensorwise"},
    "fp8-rowwise-selective": {"model.linear_kind": "fp8-rowwise", "model.grad_checkpointing_policy": "ops"},
    "adamw8bit": {"optim.optimizer": "adamw8bit"},
    "accum-freq": {"optim.accum_freq": 2},
    "chunked-loss": {"loss.loss_chunk_size": 4},
    "siglip-chunked": {"loss.loss": "siglip", "loss.loss_chunk_size": 4},
    "lock-image": {"model.lock_image": True, "model.lock_image_unlocked_groups": 1},
    "lock-text": {"model.lock_text": True},
    "all-at-once": {
        "model.force_patch_dropout": 0.5,
        "model.linear_kind": "switchback-memefficient",
        "model.grad_checkpointing_policy": "ops",
        "optim.accum_freq": 2,
        "loss.loss_chunk_size": 4,
        "optim.optimizer": "adamw8bit",
    },
}
# torch.compile rows cost ~1 min each on CPU (inductor's C++ build): the standard flags, the
# combination that mixes the most traced code (custom int8 ops, selective checkpointing, patch dropout)
# and the fp8 kind.
COMPILED_ROWS = {
    "compiled": {"model.torchcompile": True},
    "compiled-all": {**ROWS["all-at-once"], "model.torchcompile": True, "optim.optimizer": "adamw"},
    # The GPU's fastest setting: fp8 linears, selective checkpointing keeping their GEMMs, compiled.
    "compiled-fp8": {
        **ROWS["fp8-tensorwise"],
        "model.grad_checkpointing_policy": "ops",
        "model.torchcompile": True,
    },
}
ALL_ROWS = {**ROWS, **COMPILED_ROWS}
STEPS, BATCH = 2, 8

pytestmark = pytest.mark.dist


def row_config(engine: str, row: dict[str, object]) -> TrainConfig:
    overrides = {**STANDARD, **row}
    if engine != "fsdp":
        overrides |= {
            "engine.engine": "deepspeed",
            "engine.deepspeed_config": str(DS_CONFIGS / f"{engine}.json"),
        }
    return tiny_config(**overrides)


def train_rows(rank: int, world: int, engine: str, rows: dict[str, dict]) -> dict[str, object]:
    """Worker: each row of one engine in turn; a row's exception is its result (the others go on)."""
    results: dict[str, object] = {}
    for name, row in rows.items():
        try:
            cfg = row_config(engine, row)
            results[name] = run_steps(make_engine(rank, world, cfg), cfg, range(STEPS), BATCH)
        except Exception as e:  # noqa: BLE001 (reported per row by the test)
            results[name] = f"{type(e).__name__}: {e}"
    return results


def row_refusal(engine: str, row: dict[str, object]) -> str | None:
    """The refusal this machine must answer `row` with (support/machine.py), or None: it trains."""
    return expected_refusal(engine, str({**STANDARD, **row}["engine.precision"]))


def check_rows(
    results: dict[str, object], engine: str, *, refusals: dict[str, str | None] | None = None
) -> None:
    """Each row trained (finite losses), or was refused with the one line the machine calls for."""
    bad = {}
    for name, result in results.items():
        refusal = refusals[name] if refusals is not None else row_refusal(engine, ALL_ROWS.get(name, {}))
        if refusal is not None:
            ok = isinstance(result, str) and result.startswith("ConfigError") and refusal in result
        else:
            ok = isinstance(result, list) and len(result) == STEPS and all(math.isfinite(x) for x in result)
        if not ok:
            bad[name] = f"expected the refusal ({refusal}), got {result}" if refusal else result
    assert not bad, f"{engine}: rows not as expected: " + "; ".join(f"{k}: {v}" for k, v in bad.items())


@pytest.mark.parametrize("engine", ENGINES)
def test_documented_flag_combinations_train(engine: str) -> None:
    check_rows(spawn(train_rows, 1, engine, ROWS)[0], engine)


def test_fp16_row_as_on_a_cpu_without_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fp16 withheld (as on an AMD EPYC), ZeRO's fp16 row is refused with the one line and
    the rows beside it still train, whatever this CPU offers."""
    monkeypatch.setenv(WITHHOLD_FP16_ENV, "1")
    rows = {name: ROWS[name] for name in ("fp16", "standard")}
    results = spawn(train_rows, 1, "zero2", rows)[0]
    check_rows(results, "zero2", refusals={"fp16": ZERO_FP16_REFUSAL, "standard": None})


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get(LOW_STACK_ENV) != "low",
    reason="the compiled rows run on the low stack (torch 2.11, the GPU machines'), where compile bugs showed;"
    " on the main stack test_engine_deepspeed's and test_fast_compile's compiled steps cover compile",
)
@pytest.mark.parametrize("engine", ("fsdp",))  # ZeRO-3 compiled: test_engine_deepspeed, against the reference
def test_documented_flag_combinations_train_compiled(engine: str) -> None:
    check_rows(spawn(train_rows, 1, engine, COMPILED_ROWS)[0], engine)
