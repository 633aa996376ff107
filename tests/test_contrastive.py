"""Contrastive losses on one process: exactness against float64, OpenCLIP parity, bf16, bad input.

The reference builds the full global logit matrix in float64 and differentiates it with autograd.
It also defines the gradient convention every loss here must meet (the engine averages parameter
gradients over ranks): rank r's features get d(sum_r' L_r')/d(features_r); logit scale and bias get
dL_r/ds, dL_r/db. Multi-rank versions of these tests are in test_contrastive_dist.py.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from support.openclip_ref import open_clip_model_module

from bigclip.cli_args import parse_train_args
from bigclip.config import LossConfig
from bigclip.errors import ConfigError, NonFiniteLossError
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss, ClipLoss, SigLipLoss, build_loss

# (local batch, chunk): chunks that divide the local batch, that do not, local batch 1, chunk > batch.
SHAPES = [(8, 4), (6, 4), (5, 2), (1, 4), (7, 100)]


@dataclass
class Inputs:
    """A global batch of L2-normalised features, with scale and bias, shared by all ranks."""

    image: torch.Tensor  # [world * n, dim]
    text: torch.Tensor
    scale: torch.Tensor  # 0-dim, already exponentiated
    bias: torch.Tensor

    def rows(self, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.image.shape[0] // world
        return self.image[rank * n : (rank + 1) * n], self.text[rank * n : (rank + 1) * n]


def make_inputs(global_batch: int, dim: int = 16, *, seed: int = 0, scale: float = 14.3) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(global_batch, dim, generator=g), dim=-1)
    # Texts correlated with their images, as after some training: the softmax is not uniform.
    text = F.normalize(image + 0.8 * torch.randn(global_batch, dim, generator=g), dim=-1)
    return Inputs(image, text, torch.tensor(scale), torch.tensor(-3.0))


@dataclass
class Result:
    """One rank's loss and gradients (float64 numpy-free tensors)."""

    loss: float
    image: torch.Tensor
    text: torch.Tensor
    scale: float
    bias: float | None


def reference(inputs: Inputs, world: int, kind: str) -> list[Result]:
    """Per-rank losses and gradients from the full global logit matrix in float64."""
    image = inputs.image.double().requires_grad_()
    text = inputs.text.double().requires_grad_()
    scale = inputs.scale.double().requires_grad_()
    bias = inputs.bias.double().requires_grad_()
    logits = scale * image @ text.T + (bias if kind == "siglip" else 0)
    n = image.shape[0] // world
    losses = [_reference_rank_loss(logits, r, n, kind) for r in range(world)]
    d_image, d_text = torch.autograd.grad(sum(losses), [image, text], retain_graph=True)
    results = []
    for r, loss in enumerate(losses):
        d_scale, d_bias = torch.autograd.grad(loss, [scale, bias], retain_graph=True, allow_unused=True)
        rows = slice(r * n, (r + 1) * n)
        results.append(
            Result(
                loss=loss.item(),
                image=d_image[rows],
                text=d_text[rows],
                scale=d_scale.item(),
                bias=None if d_bias is None else d_bias.item(),
            )
        )
    return results


def _reference_rank_loss(logits: torch.Tensor, rank: int, n: int, kind: str) -> torch.Tensor:
    rows = slice(rank * n, (rank + 1) * n)
    labels = torch.arange(rank * n, (rank + 1) * n)
    if kind == "clip":
        return (F.cross_entropy(logits[rows], labels) + F.cross_entropy(logits.T[rows], labels)) / 2
    signs = -torch.ones_like(logits[rows])
    signs[torch.arange(n), labels] = 1
    return -F.logsigmoid(signs * logits[rows]).sum() / n


def run_loss(loss_fn: torch.nn.Module, image: torch.Tensor, text: torch.Tensor, inputs: Inputs) -> Result:
    """Forward and backward of one rank's loss on leaf copies of its inputs."""
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale, bias = inputs.scale.clone().requires_grad_(), inputs.bias.clone().requires_grad_()
    loss = loss_fn(image, text, scale, bias)
    loss.backward()
    return Result(
        loss=loss.item(),
        image=image.grad.double(),
        text=text.grad.double(),
        scale=scale.grad.item(),
        bias=None if bias.grad is None else bias.grad.item(),
    )


def assert_matches(got: Result, want: Result, *, rtol: float = 1e-5) -> None:
    """Loss and every gradient equal to `rtol` relative to the reference's largest magnitude."""
    assert got.loss == pytest.approx(want.loss, rel=rtol, abs=1e-7)
    for name in ("image", "text"):
        expected = getattr(want, name)
        atol = rtol * expected.abs().max().item() + 1e-7  # + floor: some references are exactly 0
        torch.testing.assert_close(getattr(got, name), expected, rtol=rtol, atol=atol, msg=name)
    assert got.scale == pytest.approx(want.scale, rel=rtol, abs=1e-7)
    if want.bias is not None:
        assert got.bias == pytest.approx(want.bias, rel=rtol, abs=1e-7)


@pytest.mark.parametrize("exchange", ["ring", "allgather"])
@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize(("n", "chunk"), SHAPES)
def test_chunked_loss_matches_float64_reference(kind, exchange, n, chunk):
    if kind == "clip" and n == 1:
        pytest.skip("one pair on one rank: the CLIP loss is identically 0 (covered on 2-4 ranks)")
    inputs = make_inputs(n)
    loss_fn = ChunkedContrastiveLoss(kind=kind, chunk_size=chunk, exchange=exchange)
    assert_matches(run_loss(loss_fn, inputs.image, inputs.text, inputs), reference(inputs, 1, kind)[0])


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_chunked_loss_exact_at_clip_scale_limit(kind):
    # OpenCLIP clamps the scale at 100: the sharpest softmax and largest logits the loss sees.
    inputs = make_inputs(12, 32, scale=100.0)
    loss_fn = ChunkedContrastiveLoss(kind=kind, chunk_size=5)
    assert_matches(run_loss(loss_fn, inputs.image, inputs.text, inputs), reference(inputs, 1, kind)[0])


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_unchunked_baseline_matches_float64_reference(kind):
    inputs = make_inputs(6)
    loss_fn = ClipLoss(local_loss=True, gather_with_grad=True) if kind == "clip" else SigLipLoss()
    assert_matches(run_loss(loss_fn, inputs.image, inputs.text, inputs), reference(inputs, 1, kind)[0])


def openclip_loss_module():
    open_clip_model_module()  # registers the open_clip package without its torchvision imports
    return importlib.import_module("open_clip.loss")


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_losses_equal_openclip_losses(kind):
    inputs = make_inputs(9)
    ref_loss = openclip_loss_module().ClipLoss() if kind == "clip" else openclip_loss_module().SigLipLoss()
    args = (inputs.image, inputs.text, inputs.scale) + ((inputs.bias,) if kind == "siglip" else ())
    expected = ref_loss(*args).item()
    for loss_fn in (ChunkedContrastiveLoss(kind=kind, chunk_size=4), build_loss(parse_loss_flags(kind))):
        assert loss_fn(inputs.image, inputs.text, inputs.scale, inputs.bias).item() == pytest.approx(
            expected, rel=1e-6
        )


def parse_loss_flags(kind: str, *flags: str):
    return parse_train_args(["--loss", kind, *flags]).loss


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_bf16_features_give_fp32_loss(kind):
    inputs = make_inputs(24, 64)
    loss_fn = ChunkedContrastiveLoss(kind=kind, chunk_size=7)
    fp32 = run_loss(loss_fn, inputs.image, inputs.text, inputs)
    bf16 = run_loss(loss_fn, inputs.image.bfloat16(), inputs.text.bfloat16(), inputs)
    assert bf16.loss == pytest.approx(fp32.loss, rel=1e-2)
    # The only error is the rounding of the features to bf16: logits, log-sum-exp and
    # accumulators run in fp32, so the loss equals the float64 reference on the rounded features.
    rounded = Inputs(
        inputs.image.bfloat16().float(), inputs.text.bfloat16().float(), inputs.scale, inputs.bias
    )
    assert bf16.loss == pytest.approx(reference(rounded, 1, kind)[0].loss, rel=1e-5)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_autocast_does_not_lower_the_loss_precision(kind):
    inputs = make_inputs(16, 32)
    loss_fn = ChunkedContrastiveLoss(kind=kind, chunk_size=5)
    image, text = inputs.image.requires_grad_(), inputs.text.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(image, text, inputs.scale, inputs.bias)
        loss.backward()
    want = reference(inputs, 1, kind)[0]
    assert loss.item() == pytest.approx(want.loss, rel=1e-5)
    torch.testing.assert_close(image.grad.double(), want.image, rtol=1e-5, atol=1e-5 * want.image.abs().max())


def test_bf16_gradients_have_input_dtype():
    inputs = make_inputs(4)
    image = inputs.image.bfloat16().requires_grad_()
    text = inputs.text.bfloat16().requires_grad_()
    loss = ChunkedContrastiveLoss(chunk_size=3)(image, text, inputs.scale)
    loss.backward()
    assert loss.dtype == torch.float32
    assert image.grad.dtype == text.grad.dtype == torch.bfloat16


def test_rows_without_gradient_are_negatives_only():
    # --accum-freq: cached rows are detached; only the re-run micro-batch gets gradients.
    inputs = make_inputs(6)
    live = inputs.image[:2].clone().requires_grad_()
    image = torch.cat([live, inputs.image[2:]])
    loss = ChunkedContrastiveLoss(chunk_size=4)(image, inputs.text, inputs.scale)
    loss.backward()
    want = reference(inputs, 1, "clip")[0]
    torch.testing.assert_close(live.grad.double(), want.image[:2], rtol=1e-5, atol=1e-7)


# --- configuration -----------------------------------------------------------------------


def test_flags_select_the_loss():
    chunked = build_loss(parse_loss_flags("clip", "--loss-chunk-size", "64", "--loss-exchange", "allgather"))
    assert isinstance(chunked, ChunkedContrastiveLoss)
    assert (chunked.plan.kind, chunked.plan.chunk, type(chunked.plan.exchange).__name__) == (
        "clip",
        64,
        "AllGatherExchange",
    )
    siglip = build_loss(parse_train_args(["--siglip", "--loss-chunk-size", "8"]).loss)
    assert siglip.plan.kind == "siglip" and type(siglip.plan.exchange).__name__ == "RingExchange"
    baseline = build_loss(parse_loss_flags("clip", "--local-loss", "--gather-with-grad"))
    assert isinstance(baseline, ClipLoss) and baseline.local_loss and baseline.gather_with_grad
    assert isinstance(build_loss(parse_train_args(["--siglip"]).loss), SigLipLoss)


def test_bad_loss_options_are_rejected():
    with pytest.raises(ConfigError, match="--loss-chunk-size must be 0"):
        parse_train_args(["--loss-chunk-size", "-1"])
    # Values from a YAML file skip argparse's choices; validate() still catches them.
    with pytest.raises(ConfigError, match="--loss-exchange must be one of ring, allgather"):
        LossConfig(loss_exchange="tree").validate()
    with pytest.raises(ConfigError, match="--loss must be one of clip, siglip"):
        LossConfig(loss="infonce").validate()


# --- bad input ---------------------------------------------------------------------------


def loss_fns() -> list[torch.nn.Module]:
    return [ChunkedContrastiveLoss(chunk_size=4), ClipLoss(), ChunkedContrastiveLoss(kind="siglip")]


@pytest.mark.parametrize("loss_fn", loss_fns(), ids=["chunked-clip", "baseline-clip", "chunked-siglip"])
def test_mismatched_towers_fail_clearly(loss_fn):
    inputs = make_inputs(6)
    with pytest.raises(
        ConfigError, match=r"rank 0: image features are \[6, 16\] float32 but text .* \[5, 16\]"
    ):
        loss_fn(inputs.image, inputs.text[:5], inputs.scale, inputs.bias)
    with pytest.raises(ConfigError, match="rank 0: image features are a 1-d tensor"):
        loss_fn(inputs.image[0], inputs.text[0], inputs.scale, inputs.bias)
    with pytest.raises(ConfigError, match="bfloat16"):
        loss_fn(inputs.image, inputs.text.bfloat16(), inputs.scale, inputs.bias)


@pytest.mark.parametrize("loss_fn", loss_fns(), ids=["chunked-clip", "baseline-clip", "chunked-siglip"])
def test_non_finite_logits_fail_before_any_update(loss_fn):
    inputs = make_inputs(6)
    image = inputs.image.clone()
    image[3, 5] = float("nan")
    with pytest.raises(NonFiniteLossError, match="image features on rank 0 contain NaN or inf"):
        loss_fn(image, inputs.text, inputs.scale, inputs.bias)
    with pytest.raises(NonFiniteLossError, match="logit scale on rank 0 is inf"):
        loss_fn(inputs.image, inputs.text, torch.tensor(float("inf")), inputs.bias)
    with pytest.raises(NonFiniteLossError, match="overflows float32"):
        loss_fn(inputs.image * 1e19, inputs.text * 1e19, inputs.scale, inputs.bias)


def test_siglip_without_bias_fails_clearly():
    inputs = make_inputs(4)
    for loss_fn in (SigLipLoss(), ChunkedContrastiveLoss(kind="siglip")):
        with pytest.raises(ConfigError, match="needs the model's logit_bias"):
            loss_fn(inputs.image, inputs.text, inputs.scale)
