"""A linear kind is one module and one registration (config/linear_kinds.py): a toy kind that is
none of bigclip's (support/toy_linear_kind.py) is accepted by the flag checks, checked against the
machine, swapped into the model the training loop builds, and trains; the planner prices it."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from support import toy_linear_kind

from bigclip.cli_args import parse_train_args
from bigclip.config import linear_kinds
from bigclip.errors import ConfigError
from bigclip.models.from_config import build_model
from bigclip.train.preflight import check_machine


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(linear_kinds, "LINEAR_KINDS", dict(linear_kinds.LINEAR_KINDS))  # this test only
    return toy_linear_kind.register()


def run_config(kind: str, **engine: str):
    cfg = parse_train_args(["--model", "tiny", "--train-data", "x/{0..1}.tar", "--precision", "fp32"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, linear_kind=kind))
    cfg.engine = dataclasses.replace(cfg.engine, **engine)
    cfg.validate()
    return cfg


def test_a_registered_kind_is_swapped_into_the_model_the_loop_builds_and_trains(toy, caplog):
    with caplog.at_level(logging.INFO, logger="bigclip.models"):
        model = build_model(run_config(toy.name), device="cpu")
    plain = build_model(run_config("none"), device="cpu")
    blocks = [*model.visual.transformer.resblocks, *model.transformer.resblocks]
    assert all(isinstance(b.mlp.c_fc, toy_linear_kind.RoundedLinear) for b in blocks)
    assert not any(isinstance(b.attn.out_proj, toy_linear_kind.RoundedLinear) for b in blocks)  # "never"
    assert "linear kind toy-bf16-weights: 8 MLP linears read bfloat16-rounded weights" in caplog.text
    assert list(model.state_dict()) == list(plain.state_dict())  # checkpoints do not depend on the kind
    model.load_state_dict(plain.state_dict())
    images, texts = torch.randn(4, 3, 64, 64), torch.randint(1, 1000, (4, 32))
    texts[:, 9] = 49407
    ours, theirs = model(images, texts), plain(images, texts)
    close = torch.allclose(ours["image_features"], theirs["image_features"], atol=2e-2)
    assert close and not torch.equal(ours["image_features"], theirs["image_features"])  # it ran
    loss = ours["image_features"].sum() + ours["text_features"].sum()
    loss.backward()
    assert blocks[0].mlp.c_fc.weight.grad is not None and blocks[0].mlp.c_fc.weight.grad.abs().sum() > 0


def test_a_registered_kind_checks_the_machine_before_the_run(toy):
    with pytest.raises(
        ConfigError, match="--linear-kind toy-bf16-weights runs on CPUs only; this run computes on cuda"
    ):
        toy_linear_kind.check_machine(toy, "cuda")
    toy_linear_kind.CHECKED.clear()
    check_machine(run_config(toy.name, device="cpu"))
    assert toy_linear_kind.CHECKED == ["cpu"]  # the run's machine check asked the kind's own


def test_an_unregistered_kind_is_refused_naming_the_registered_ones():
    with pytest.raises(
        ConfigError, match=r"--linear-kind 'toy-bf16-weights' is unknown; choose from none, switchback"
    ):
        run_config("toy-bf16-weights")


def test_the_planner_prices_a_registered_kind(toy):
    """As 16-bit linears: the kind declares no int8-saved inputs (LinearKind.int8_saved_inputs)."""
    from bigclip.plan.memory import activation_bytes
    from bigclip.plan.spec import from_train_config

    spec = from_train_config(run_config(toy.name), gpus=2)
    assert spec.linear_kind == toy.name
    assert activation_bytes(spec) == activation_bytes(dataclasses.replace(spec, linear_kind="none"))
    memefficient = dataclasses.replace(spec, linear_kind="switchback-memefficient", linear_filter="all")
    assert activation_bytes(memefficient) < activation_bytes(spec)
