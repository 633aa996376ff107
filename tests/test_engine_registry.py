"""A training engine is one class and one registration (config/engine.py): a toy engine that is
none of bigclip's (support/toy_engine.py, plain data parallelism) is a --engine value, checked
against the machine by its own check, trained by the real loop on 2 ranks over gloo to the same
weights as FSDP2, checkpointed, and planned by its plan kind (support/toy_engine_plan.py)."""

from __future__ import annotations

import pytest
import torch
from support import toy_engine, toy_engine_plan
from support.train_harness import demo_argv, train_and_weights

from bigclip.cli_args import parse_train_args
from bigclip.config import engine as engine_config
from bigclip.distributed import spawn
from bigclip.errors import ConfigError
from bigclip.plan import engine_plan
from bigclip.plan.options import Hardware
from bigclip.plan.planner import build_plan
from bigclip.plan.spec import from_train_config
from bigclip.train.preflight import check_machine


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(engine_config.ENGINES, toy_engine.NAME, "")  # removed again after the test
    toy_engine.register()
    engine_plan.engine_kinds()  # the built-in plans first, then this test's registry holds them and the toy's
    monkeypatch.setattr(engine_plan, "ENGINE_PLANS", dict(engine_plan.ENGINE_PLANS))
    toy_engine_plan.register()


def argv(demo_data, tmp_path, engine: str, *extra: str) -> list[str]:
    return [*demo_argv(demo_data, tmp_path, "--engine", engine, *extra, name=engine), "--max-steps", "4"]


def toy_train_and_weights(rank: int, world: int, args: list[str]) -> dict:
    """Worker: a fresh process registers the toy engine (its import did, in the user's code), then trains."""
    toy_engine.register()
    return train_and_weights(rank, world, args)


def test_an_unregistered_engine_is_refused_naming_the_registered_ones():
    with pytest.raises(
        ConfigError, match=r"--engine: invalid choice: 'toy-replicas' \(choose from 'fsdp', 'deepspeed'\)"
    ):
        parse_train_args(["--model", "tiny", "--train-data", "x/{0..1}.tar", "--engine", toy_engine.NAME])
    with pytest.raises(
        ConfigError, match=r"--engine 'toy-replicas' is unknown; choose from fsdp, deepspeed$"
    ):
        engine_config.EngineConfig(engine=toy_engine.NAME).validate()  # a YAML file's value


def test_a_registered_engine_checks_the_machine_and_is_planned_by_its_kind(toy, demo_data, tmp_path):
    cfg = parse_train_args(argv(demo_data, tmp_path, toy_engine.NAME))
    check_machine(cfg)  # fp32: its own check passes
    plan = build_plan(from_train_config(cfg, gpus=8), Hardware())
    assert plan.spec.engine == toy_engine.NAME  # the toy plan's terms price it
    assert plan.memory.communication == 2 * toy_engine_plan.BUCKET_BYTES
    bf16 = parse_train_args([*argv(demo_data, tmp_path, toy_engine.NAME), "--precision", "amp_bf16"])
    with pytest.raises(
        ConfigError, match=r"--engine toy-replicas computes in fp32 only; .* --precision amp_bf16$"
    ):
        check_machine(bf16)


@pytest.mark.dist
def test_the_loop_trains_a_registered_engine_to_fsdps_weights_and_checkpoints_it(toy, demo_data, tmp_path):
    """fp32 on both: the same data, initial weights, averaged gradients and AdamW steps, so the
    weights after 4 steps agree to rounding (FSDP2 reduce-scatters, the toy all-reduces)."""
    save = ["--save-every-n-steps", "4"]
    ours = spawn(toy_train_and_weights, 2, argv(demo_data, tmp_path, toy_engine.NAME, *save))[0]
    fsdp = spawn(train_and_weights, 2, argv(demo_data, tmp_path, "fsdp"))[0]
    assert ours["step"] == fsdp["step"] == 4
    assert ours["weights"].keys() == fsdp["weights"].keys()
    for name, value in ours["weights"].items():
        torch.testing.assert_close(value, fsdp["weights"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert (tmp_path / toy_engine.NAME / "checkpoints").is_dir()
