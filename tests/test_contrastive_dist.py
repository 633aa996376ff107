"""Contrastive losses on 2-4 real processes over gloo: exactness, accumulation, bad input.

Each test spawns one group of ranks and runs all of its cases there (process start-up dominates).
Workers return numpy arrays, compared in the parent with the float64 reference of
test_contrastive.py: rank r's loss L_r; its features' gradient d(sum_r' L_r')/d(features_r); its
logit scale/bias gradient dL_r/ds, dL_r/db.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_contrastive import SHAPES, Inputs, Result, assert_matches, make_inputs, reference, run_loss

from bigclip.distributed import spawn
from bigclip.errors import ConfigError, NonFiniteLossError
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss, ClipLoss, SigLipLoss

pytestmark = pytest.mark.dist

CHUNKED = [(kind, exchange) for kind in ("clip", "siglip") for exchange in ("ring", "allgather")]


def _to_numpy(result: Result) -> dict:
    return {**vars(result), "image": result.image.numpy(), "text": result.text.numpy()}


def _from_numpy(values: dict) -> Result:
    return Result(
        **{**values, "image": torch.from_numpy(values["image"]), "text": torch.from_numpy(values["text"])}
    )


def exactness_worker(rank: int, world: int, cases: list[tuple[str, str, Inputs]]) -> list[dict]:
    results = []
    for label, kind, inputs in cases:
        loss_fn = _loss_for(label, kind, rank, world)
        image, text = inputs.rows(rank, world)
        results.append(_to_numpy(run_loss(loss_fn, image, text, inputs)))
    return results


def _loss_for(label: str, kind: str, rank: int, world: int) -> torch.nn.Module:
    if label == "baseline":
        return ClipLoss(local_loss=True, gather_with_grad=True) if kind == "clip" else SigLipLoss()
    if label == "openclip":
        from support.openclip_ref import open_clip_model_module

        open_clip_model_module()
        loss = importlib.import_module("open_clip.loss")
        if kind == "clip":
            return loss.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
        return loss.SigLipLoss(rank=rank, world_size=world)
    exchange, chunk = label.split(":")
    return ChunkedContrastiveLoss(kind=kind, chunk_size=int(chunk), exchange=exchange)


def exactness_cases(world: int) -> list[tuple[str, str, Inputs]]:
    cases = []
    for i, (n, chunk) in enumerate(SHAPES):
        inputs = make_inputs(world * n, seed=i)
        cases += [(f"{exchange}:{chunk}", kind, inputs) for kind, exchange in CHUNKED]
    inputs = make_inputs(world * 5, seed=99)
    cases += [(label, kind, inputs) for label in ("baseline", "openclip") for kind in ("clip", "siglip")]
    return cases


@pytest.mark.parametrize("world", [2, 3, 4])
def test_losses_match_float64_reference_across_ranks(world):
    cases = exactness_cases(world)
    per_rank = spawn(exactness_worker, world, cases)
    for i, (label, kind, inputs) in enumerate(cases):
        want = reference(inputs, world, kind)
        for rank in range(world):
            got = _from_numpy(per_rank[rank][i])
            if label == "openclip":  # OpenCLIP's loss: compare the loss only (its own code)
                assert got.loss == pytest.approx(want[rank].loss, rel=1e-5), (label, kind, rank)
                continue
            try:
                assert_matches(got, want[rank])
            except AssertionError as e:
                raise AssertionError(f"{label} {kind} world={world} rank={rank}: {e}") from e


# --- feature caching (--accum-freq) ----------------------------------------------------------


def accumulation_worker(rank: int, world: int, kind: str, k: int, b: int) -> list[np.ndarray]:
    """Parameter gradients of one K*b step vs K cached-feature passes (OpenCLIP's accum-freq)."""
    torch.manual_seed(0)
    tower = torch.nn.Linear(8, 16)
    log_scale = torch.nn.Parameter(torch.tensor(2.0))
    bias = torch.nn.Parameter(torch.tensor(-2.0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * k * b, 8, generator=g)[rank * k * b : (rank + 1) * k * b]
    y = torch.randn(world * k * b, 8, generator=g)[rank * k * b : (rank + 1) * k * b]
    loss_fn = ChunkedContrastiveLoss(kind=kind, chunk_size=3)

    def features(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.nn.functional.normalize(tower(x[rows]), dim=-1),
            torch.nn.functional.normalize(tower(y[rows]) + 0.1, dim=-1),
        )

    params = [*tower.parameters(), log_scale] + ([bias] if kind == "siglip" else [])
    loss_fn(*features(slice(None)), log_scale.exp(), bias).backward()
    one_step = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    micro = [slice(j * b, (j + 1) * b) for j in range(k)]
    with torch.no_grad():
        cached = [features(rows) for rows in micro]
    for j, rows in enumerate(micro):
        live = features(rows)
        image, text = (torch.cat([live[t] if i == j else c[t] for i, c in enumerate(cached)]) for t in (0, 1))
        last = j == k - 1  # scale and bias keep their gradient in one pass only
        scale = log_scale.exp() if last else log_scale.exp().detach()
        loss_fn(image, text, scale, bias if last else bias.detach()).backward()
    accumulated = [p.grad.clone() for p in params]
    for grads in (one_step, accumulated):
        for grad in grads:
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)  # what the engine does
    return [torch.cat([t.flatten() for t in grads]).numpy() for grads in (one_step, accumulated)]


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_cached_feature_accumulation_gives_the_full_batch_update(kind):
    for one_step, accumulated in spawn(accumulation_worker, 2, kind, 3, 2):
        np.testing.assert_allclose(accumulated, one_step, rtol=1e-5, atol=1e-5 * np.abs(one_step).max())


# --- bad input: every rank raises the same error, naming the offending rank ------------------


def bad_input_worker(rank: int, world: int) -> dict[str, tuple[str, str]]:
    inputs = make_inputs(world * 4)
    image, text = inputs.rows(rank, world)
    scenarios = {
        "batch": (image[:3], text[:3]) if rank == 1 else (image, text),
        "dtype": (image.bfloat16(), text.bfloat16()) if rank == 1 else (image, text),
        "nan": (image.clone().fill_(float("nan")), text) if rank == 1 else (image, text),
    }
    outcomes = {}
    for name, (img, txt) in scenarios.items():
        for loss_fn in (
            ChunkedContrastiveLoss(chunk_size=2),
            ClipLoss(local_loss=True, gather_with_grad=True),
        ):
            try:
                loss_fn(img, txt, inputs.scale).backward()
                outcomes[f"{name}/{type(loss_fn).__name__}"] = ("ok", "")
            except (ConfigError, NonFiniteLossError) as e:
                outcomes[f"{name}/{type(loss_fn).__name__}"] = (type(e).__name__, str(e))
    # After all those errors the ranks are still in step: a good call works everywhere.
    loss = ChunkedContrastiveLoss(chunk_size=2)(image, text, inputs.scale)
    outcomes["after"] = ("ok", repr(loss.item()))
    return outcomes


def test_bad_input_fails_on_every_rank_naming_the_rank():
    per_rank = spawn(bad_input_worker, 3, timeout_s=120)
    expected = {
        "batch": ("ConfigError", "rank 1 has features [3, 16] float32 but rank 0 has [4, 16] float32"),
        "dtype": ("ConfigError", "rank 1 has features [4, 16] bfloat16"),
        "nan": ("NonFiniteLossError", "image features on rank 1 contain NaN or inf"),
    }
    for outcomes in per_rank:
        for key, (kind, message) in outcomes.items():
            if key == "after":
                continue
            want_kind, want_text = expected[key.split("/")[0]]
            assert kind == want_kind and want_text in message, (key, kind, message)
        assert outcomes["after"][0] == "ok"
    global_loss = np.mean([float(o["after"][1]) for o in per_rank])
    want = np.mean([r.loss for r in reference(make_inputs(3 * 4), 3, "clip")])
    assert global_loss == pytest.approx(want, rel=1e-5)


# --- memory: flat in the world size ---------------------------------------------------------


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def fake_rank0_peak_mib(method: str, world: int, local: int, chunk: int) -> float:
    """Rank 0's peak loss memory under the fake process group, by benchmarks/loss_memory.py."""
    sys.path.insert(0, str(BENCHMARKS))
    import loss_memory

    return loss_memory.fake_worker("memory", world, local, chunk, method=method)["peak_MiB"]


def test_ring_loss_memory_does_not_grow_with_world_size():
    # The benchmark's own instrument, at sizes a test can afford (embed dim 1280, local batch 32).
    spawn_context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn_context) as pool:
        peaks = {
            (method, world): pool.submit(fake_rank0_peak_mib, method, world, 32, 16).result()
            for method in ("ring", "allgather", "unchunked")
            for world in (4, 32)
        }
    # From 3 ranks on, the ring holds the same buffers (2 ranks need one receive buffer less).
    assert peaks["ring", 32] == peaks["ring", 4]
    for method in ("allgather", "unchunked"):  # gathering losses grow with the global batch
        assert peaks[method, 32] > 4 * peaks[method, 4]
    assert peaks["unchunked", 32] > 10 * peaks["ring", 32]
