"""Every flag combination the README tells a GPU user to make trains, on both engines and both CI stacks.

One table, not one test per bug: each row starts from the standard large-run flags (amp_bf16 and
activation checkpointing) and adds what a user combines with them. Each row trains 2 steps of the
tiny model with the real engine (world of one over gloo) and must give finite, decreasing-capable
losses; rows the README documents as refused must be refused before anything is built, with a
message that says what to do. A failure names the row, so a crash like torch 2.11's amp_bf16 +
checkpointing one shows up as one red row here rather than on a GPU.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from support.engine_harness import make_engine, run_steps, tiny_config
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
    "switchback-global": {"model.int8": "switchback-global"},
    "switchback-vectorwise": {"model.int8": "switchback-vectorwise"},
    "switchback-memefficient-attention": {
        "model.int8": "switchback-memefficient",
        "model.int8_attention": True,
    },
    "adamw8bit": {"optim.optimizer": "adamw8bit"},
    "accum-freq": {"optim.accum_freq": 2},
    "chunked-loss": {"loss.loss_chunk_size": 4},
    "siglip-chunked": {"loss.loss": "siglip", "loss.loss_chunk_size": 4},
    "lock-image": {"model.lock_image": True, "model.lock_image_unlocked_groups": 1},
    "lock-text": {"model.lock_text": True},
    "all-at-once": {
        "model.force_patch_dropout": 0.5,
        "model.int8": "switchback-memefficient",
        "model.grad_checkpointing_policy": "ops",
        "optim.accum_freq": 2,
        "loss.loss_chunk_size": 4,
        "optim.optimizer": "adamw8bit",
    },
}
# torch.compile rows cost ~1 min each on CPU (inductor's C++ build): the standard flags, and the
# combination that mixes the most traced code (custom int8 ops, selective checkpointing, patch dropout).
COMPILED_ROWS = {
    "compiled": {"model.torchcompile": True},
    "compiled-all": {**ROWS["all-at-once"], "model.torchcompile": True, "optim.optimizer": "adamw"},
}
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


def check_rows(results: dict[str, object], engine: str) -> None:
    bad = {}
    for name, result in results.items():
        if not (isinstance(result, list) and len(result) == STEPS and all(math.isfinite(x) for x in result)):
            bad[name] = result
    assert not bad, f"{engine}: rows that did not train: " + "; ".join(f"{k}: {v}" for k, v in bad.items())


@pytest.mark.parametrize("engine", ENGINES)
def test_documented_flag_combinations_train(engine: str) -> None:
    check_rows(spawn(train_rows, 1, engine, ROWS)[0], engine)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get(LOW_STACK_ENV) != "low",
    reason="the compiled rows run on the low stack (torch 2.11, the GPU machines'), where compile bugs showed;"
    " on the main stack test_engine_deepspeed's and test_fast_compile's compiled steps cover compile",
)
@pytest.mark.parametrize("engine", ("fsdp",))  # ZeRO-3 compiled: test_engine_deepspeed, against the reference
def test_documented_flag_combinations_train_compiled(engine: str) -> None:
    check_rows(spawn(train_rows, 1, engine, COMPILED_ROWS)[0], engine)
