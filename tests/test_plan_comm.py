"""The planner's price of the chunked loss's exchange: the bytes the real loss sends on real gloo
ranks, and the seconds `bigclip plan` reports for them at --link-gbps. The priced time against a
rate-limited link between two network namespaces is benchmarks/plan_vs_measured.py --link."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bigclip.distributed import spawn
from bigclip.errors import ConfigError
from bigclip.ops.loss import exchange as exchange_module
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss
from bigclip.plan.comm import ExchangeShape, exchange_bytes, loss_exchange_bytes, transfer_seconds
from bigclip.plan.command import main
from bigclip.plan.planner import Hardware, build_plan
from bigclip.plan.spec import PlanSpec

WORLD, LOCAL, DIM, CHUNK = 3, 10, 8, 4


CASES = [(kind, method) for kind in ("clip", "siglip") for method in ("ring", "allgather")]


def _count_sent(rank: int, world: int) -> dict[tuple[str, str], dict[str, int]]:
    """Per (kind, exchange): one forward + backward of the chunked loss, counting what this rank
    hands to gloo: point-to-point sends, and per collective what its ring algorithm sends per rank."""
    sent: dict[str, int] = {}
    real_batch, real_gather = dist.batch_isend_irecv, exchange_module.all_gather_single
    real_rs, real_a2a = exchange_module.reduce_scatter_single, dist.all_to_all_single

    def batch(ops: list) -> list:
        sent["p2p"] += sum(o.tensor.nbytes for o in ops if o.op is dist.isend)
        return real_batch(ops)

    def gather(out: torch.Tensor, x: torch.Tensor, **kw: object) -> None:
        sent["gather"] += out.nbytes * (world - 1) // world
        real_gather(out, x, **kw)

    def reduce_scatter(out: torch.Tensor, x: torch.Tensor, **kw: object) -> None:
        sent["reduce_scatter"] += x.nbytes * (world - 1) // world
        real_rs(out, x, **kw)

    def all_to_all(out: torch.Tensor, x: torch.Tensor, **kw: object) -> None:
        sent["all_to_all"] += x.nbytes * (world - 1) // world
        real_a2a(out, x, **kw)

    dist.batch_isend_irecv, dist.all_to_all_single = batch, all_to_all
    exchange_module.all_gather_single, exchange_module.reduce_scatter_single = gather, reduce_scatter
    counts = {}
    for kind, method in CASES:
        sent.update(p2p=0, gather=0, reduce_scatter=0, all_to_all=0)
        g = torch.Generator().manual_seed(rank)
        image, text = (
            F.normalize(torch.randn(LOCAL, DIM, generator=g), dim=-1).requires_grad_() for _ in "it"
        )
        loss = ChunkedContrastiveLoss(kind=kind, chunk_size=CHUNK, exchange=method, check_inputs=False)
        bias = torch.tensor(-10.0, requires_grad=True) if kind == "siglip" else None
        loss(image, text, torch.tensor(10.0, requires_grad=True), bias).backward()
        counts[kind, method] = dict(sent)
    return counts


@pytest.mark.slow
def test_planned_bytes_equal_what_the_real_loss_sends() -> None:
    """Ring: the exact bytes of every send. All-gather: every collective the exchange runs, at
    NCCL's ring cost ((W-1)/W of the gathered output or reduced input per rank)."""
    ranks = spawn(_count_sent, WORLD)
    for kind in ("clip", "siglip"):
        shape = ExchangeShape(kind=kind, exchange="ring", local=LOCAL, world=WORLD, dim=DIM, feature_bytes=4)
        for counts in ranks:
            assert counts[kind, "ring"] == {"p2p": exchange_bytes(shape), "gather": 0, "reduce_scatter": 0,
                                            "all_to_all": 0}  # fmt: skip
        gathered = ranks[0][kind, "allgather"]
        assert gathered["p2p"] == 0 and gathered["gather"] > 0
        assert sum(gathered.values()) == exchange_bytes(replace(shape, exchange="allgather"))
        # gloo runs a reduce-scatter as an all-reduce: twice the bytes (measured over a real link).
        gloo = exchange_bytes(replace(shape, exchange="allgather", backend="gloo"))
        assert gloo == sum(gathered.values()) + gathered["reduce_scatter"]


def test_bigg_exchange_is_priced_per_step_at_the_link_rate(capsys: pytest.CaptureFixture) -> None:
    """ViT-bigG-14 (embed dim 1280) at 1024 GPUs x 160, bf16 features: the ring sends 1023 hops of
    each rank's text features forward and backward, and 1024 hops of fp32 accumulators."""
    spec = PlanSpec(model="ViT-bigG-14", gpus=1024, batch_size=160, loss_chunk_size=1024)
    n, d = 160, 1280
    expected = 1023 * n * d * 2 + 4 * 1024 * n + 1023 * n * (2 * d + 8) + 4 * 1024 * n * (d + 1)
    assert loss_exchange_bytes(spec) == expected
    plan = build_plan(spec, Hardware(link_gbps=100.0))
    assert plan.loss_exchange_s == pytest.approx(expected * 8 / 100e9)
    assert transfer_seconds(10**9, link_gbps=8.0) == pytest.approx(1.0)
    # --accum-freq 2: two loss calls per step, each over both micro-batches' cached rows.
    accum = loss_exchange_bytes(replace(spec, accum_freq=2))
    assert accum == 2 * exchange_bytes(ExchangeShape("clip", "ring", 2 * n, 1024, d, 2))
    assert loss_exchange_bytes(replace(spec, loss_chunk_size=0)) is None
    argv = ["--gpus", "1024", "--model", "ViT-bigG-14", "--batch-size", "160", "--loss-chunk-size", "1024"]
    assert main([*argv, "--link-gbps", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss_exchange_s"] == pytest.approx(plan.loss_exchange_s)
    with pytest.raises(ConfigError, match="--link-gbps"):
        main([*argv, "--link-gbps", "0"])
