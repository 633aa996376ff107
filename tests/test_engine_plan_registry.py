"""An engine kind's plan is one module and one registration (plan/engine_plan.py): a toy kind
that is none of bigclip's (support/toy_engine_plan.py, plain data parallelism) is planned, priced
and advised by the real planner, which asks the kind and never branches on its name."""

from __future__ import annotations

import dataclasses

import pytest
from support import toy_engine_plan

from bigclip.errors import ConfigError
from bigclip.plan import engine_plan
from bigclip.plan.advice import advise
from bigclip.plan.options import Hardware
from bigclip.plan.planner import build_plan
from bigclip.plan.spec import PlanSpec

SPEC = PlanSpec(model="ViT-B-32", gpus=8, batch_size=64, engine="toy-replicas")


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch):
    engine_plan.engine_kinds()  # the built-in kinds first, then this test's registry holds them and the toy
    monkeypatch.setattr(engine_plan, "ENGINE_PLANS", dict(engine_plan.ENGINE_PLANS))
    return toy_engine_plan.register()


def test_an_unregistered_kind_is_refused_naming_the_kinds():
    with pytest.raises(ConfigError, match=r"engine 'toy-replicas': use one of fsdp, zero1, zero2, zero3$"):
        build_plan(SPEC, Hardware())


def test_the_planner_prices_a_registered_kind_by_its_own_terms(toy):
    plan = build_plan(SPEC, Hardware())
    params = SPEC.model_shape().params
    numel = sum(p.numel for p in params)
    # Whole fp32 weights, gradients and two AdamW moments on every rank, whatever the world size.
    assert (plan.memory.state.parameters, plan.memory.state.gradients) == (4 * numel, 4 * numel)
    assert plan.memory.state.optimizer == 8 * numel
    assert plan.memory.communication == 2 * toy_engine_plan.BUCKET_BYTES
    assert plan.memory.persistent_gradients == 4 * numel  # the base class's: accumulators live on
    assert plan.checkpoint_rank0_bytes == plan.checkpoint_total_bytes  # rank 0 owns all of it
    assert plan.checkpoint is None  # no checkpoint layout: its coordination is not simulated
    # The kind's numbers are the planner's: one rank of FSDP holds what every replica holds (and,
    # on one GPU, the bf16 copy of each weight beside its fp32 master, engines/master_weights.py),
    # and FSDP at 8 ranks shards it where the replicas do not.
    one_fsdp = build_plan(dataclasses.replace(SPEC, gpus=1, engine="fsdp"), Hardware()).memory.state
    bf16_copies = 2 * sum(p.numel for p in params if p.shape)  # the 0-dim logit scale: its own master
    assert one_fsdp == dataclasses.replace(plan.memory.state, parameters=4 * numel + bf16_copies)
    eight_fsdp = build_plan(dataclasses.replace(SPEC, engine="fsdp"), Hardware()).memory.state
    assert plan.memory.state.optimizer / 8 <= eight_fsdp.optimizer < plan.memory.state.optimizer / 7


def test_advice_replans_a_registered_kind(toy):
    """Too little memory for ViT-L-14's replicas: the largest term's remedies are each re-planned
    under the toy kind (none is an FSDP flag: the kind has no communication remedies)."""
    spec = dataclasses.replace(SPEC, model="ViT-L-14", batch_size=8)
    plan = build_plan(spec, Hardware(gpu_memory_gib=4))
    advice = advise(plan, build_plan)
    assert not plan.fits and advice.largest[0] == "model state"
    assert advice.remedies and all(peak < plan.memory.peak for _, peak, _ in advice.remedies)
    assert "--optimizer adamw8bit" in [flags for flags, _, _ in advice.remedies]


def test_the_dry_run_of_a_kind_without_one_says_so(toy):
    with pytest.raises(ConfigError, match="no dry run for toy-replicas"):
        engine_plan.engine_plan("toy-replicas").dry_run(None, None)  # type: ignore[arg-type]
