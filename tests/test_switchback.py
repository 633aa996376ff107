"""SwitchBack int8 linears on the PyTorch path: numerics against fp32 nn.Linear within the error
bound derived in bigclip.ops.int8.switchback, quantisation rules, bad input, and the model swap."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigclip.errors import ConfigError
from bigclip.models.clip import CLIP, CLIPConfig, TextConfig, VisionConfig
from bigclip.models.factory import create_model
from bigclip.ops.int8 import custom_ops as switchback_ops
from bigclip.ops.int8 import torch_path as switchback_torch
from bigclip.ops.int8.switchback import (
    INT8_MODES,
    LINEAR_CLASSES,
    SwitchBackLinear,
    SwitchBackLinearGlobal,
    SwitchBackProjection,
    apply_int8,
    report_nonfinite_inputs,
)

QUANTIZATIONS = list(LINEAR_CLASSES)


def _activations(rows: int, features: int, *, seed: int) -> torch.Tensor:
    """Gaussian rows with a few outlier features, as in transformer activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g)
    x[:, :3] *= 12.0
    return x


def _group_absmax(w: torch.Tensor, quantization: str, dim: int) -> torch.Tensor:
    """Absmax of the weight group each output sees: per tensor, or per row (dim=1) / column (dim=0)."""
    if quantization == "vectorwise":
        return w.abs().amax(dim)
    return w.abs().amax().expand(w.shape[1 - dim])


def _bound_and_variance(x: torch.Tensor, w: torch.Tensor, b_absmax: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per element of x @ w^T: the module docstring's worst-case bound, and the variance of the
    error if the rounding errors are independent and uniform (variance 1/12 of a step)."""
    x, w, b = x.double(), w.double(), b_absmax.double()
    a = x.abs().amax(1)
    k = x.shape[1]
    bound = (b[None, :] * x.abs().sum(1)[:, None] + a[:, None] * w.abs().sum(1)[None, :]) / 254
    bound += 3 * k * a[:, None] * b[None, :] / (4 * 127**2)
    variance = (b[None, :] ** 2 * (x**2).sum(1)[:, None] + a[:, None] ** 2 * (w**2).sum(1)[None, :]) / (
        127**2 * 12
    )
    return bound, variance


def _check_error(
    approx: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, variance: torch.Tensor, u: float
) -> None:
    err = approx.double() - exact
    # Plus the rounding of the result to its dtype (unit roundoff u) and fp32 epilogue arithmetic.
    allowed = bound + exact.abs() * (u + 1e-6) + 1e-6
    assert (err.abs() <= allowed).all(), (err.abs() / allowed).max()
    # The typical error matches the independent-rounding estimate (output rounding included):
    # catches biased rounding (truncation) and wrong scales that the worst case is too loose for.
    predicted = (variance + exact**2 * u**2 / 3).mean().sqrt().item()
    assert err.pow(2).mean().sqrt().item() == pytest.approx(predicted, rel=0.1)


def _run_layer(quantization: str, dtype: torch.dtype, *, rows: int = 192, k: int = 320, n: int = 160):
    torch.manual_seed(0)
    ref = nn.Linear(k, n)
    x = _activations(rows, k, seed=1).to(dtype)
    layer = LINEAR_CLASSES[quantization].from_linear(nn.Linear(k, n)).to(dtype)
    layer.load_state_dict(ref.state_dict())
    x_in = x.clone().requires_grad_()
    y = layer(x_in)
    g = torch.randn(rows, n, generator=torch.Generator().manual_seed(2)).to(dtype)
    y.backward(g)
    return x, layer, y, g, x_in.grad


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_forward_within_derived_error_bound(quantization, dtype):
    x, layer, y, _, _ = _run_layer(quantization, dtype)
    w = layer.weight.detach()
    exact = F.linear(x.double(), w.double(), layer.bias.detach().double())
    bound, variance = _bound_and_variance(x, w, _group_absmax(w.float(), quantization, dim=1))
    assert y.dtype == dtype
    _check_error(y, exact, bound, variance, UNIT_ROUNDOFF[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_input_gradient_within_derived_error_bound(quantization, dtype):
    _, layer, _, g, grad_x = _run_layer(quantization, dtype)
    w = layer.weight.detach()
    exact = g.double() @ w.double()
    # grad_x = g @ W: rows of g against columns of W, each column with its backward scale.
    bound, variance = _bound_and_variance(g, w.t(), _group_absmax(w.float(), quantization, dim=0))
    assert grad_x.dtype == dtype
    _check_error(grad_x, exact, bound, variance, UNIT_ROUNDOFF[dtype])


@pytest.mark.parametrize("quantization", ["global", "vectorwise"])
def test_weight_and_bias_gradients_are_the_16bit_ones(quantization):
    x, layer, _, g, _ = _run_layer(quantization, torch.float32)
    torch.testing.assert_close(layer.weight.grad, g.t() @ x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, g.sum(0), rtol=1e-5, atol=1e-5)


def test_memefficient_weight_gradient_within_bound():
    """It sees the dequantised input: |error| <= sum_m |g_mn| absmax_m / 254."""
    x, layer, _, g, _ = _run_layer("memefficient", torch.float32)
    exact = g.double().t() @ x.double()
    bound = g.double().abs().t() @ (x.double().abs().amax(1) / 254)
    err = (layer.weight.grad.double() - exact).abs()
    assert (err <= bound[:, None] + 1e-5 * exact.abs() + 1e-5).all()
    assert err.max() > 0  # it really used the int8 copy


def test_int8_matmul_accumulates_exactly_in_int32():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (33, 4096), dtype=torch.int8, generator=g)
    a[0] = 127  # the largest possible sum: 127^2 * K
    b = torch.randint(-127, 128, (24, 4096), dtype=torch.int8, generator=g)
    b[0] = 127
    acc = switchback_torch.int8_matmul_int32(a, b)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.long(), a.long() @ b.long().t())
    assert acc[0, 0] == 127**2 * 4096


def test_quantization_rounds_half_to_even_and_maps_absmax_to_127():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -126.5, 3.49]])
    q, absmax = switchback_torch.quantize_rows(x)
    assert q.tolist() == [[127, 0, 2, 2, -2, -126, 3]]
    assert absmax.item() == 127.0


def test_zero_rows_quantize_to_zero_and_give_the_bias():
    layer = SwitchBackLinearGlobal(32, 16)
    x = torch.zeros(3, 32)
    q, _ = switchback_torch.quantize_rows(x)
    assert not q.any()
    torch.testing.assert_close(layer(x), layer.bias.detach().expand(3, 16))


def test_nonfinite_inputs_give_nan_rows_and_are_reported():
    torch.manual_seed(0)
    layer = SwitchBackLinearGlobal(64, 32)
    x = torch.randn(5, 64)
    clean = layer(x)
    x[1, 3], x[3, 0] = float("nan"), float("inf")
    out = layer(x)
    assert out[[1, 3]].isnan().all()  # propagated like nn.Linear, not rounded into int8 values
    assert torch.equal(out[[0, 2, 4]], clean[[0, 2, 4]])
    with pytest.warns(UserWarning, match="NaN/inf inputs.*'': 2"):
        assert report_nonfinite_inputs(layer) == {"": 2}
    assert report_nonfinite_inputs(layer) == {}  # counts reset after a report


def test_nonfinite_output_gradient_propagates():
    """fp16 loss scaling relies on overflowing gradients staying non-finite so the step is skipped."""
    layer = SwitchBackLinearGlobal(32, 16)
    x = torch.randn(4, 32, requires_grad=True)
    g = torch.ones(4, 16)
    g[2, 5] = float("inf")
    layer(x).backward(g)
    assert x.grad[2].isnan().all() and x.grad[[0, 1, 3]].isfinite().all()
    assert not layer.weight.grad.isfinite().all()


def test_unsupported_sizes_stay_16bit_with_one_warning():
    with pytest.warns(UserWarning, match="multiples of 16") as record:
        layer = SwitchBackLinearGlobal(20, 48)
        x = torch.randn(3, 20)
        out = layer(x)
        layer(x)
    assert len(record) == 1
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


def _odd_width_model() -> CLIP:
    vision = VisionConfig(image_size=32, layers=2, width=72, head_width=36, patch_size=8)
    text = TextConfig(context_length=16, vocab_size=1000, width=64, heads=2, layers=1)
    return CLIP(CLIPConfig(embed_dim=32, vision_cfg=vision, text_cfg=text), device="meta")


def test_apply_int8_skips_unsupported_layers_with_one_warning():
    model = _odd_width_model()
    with pytest.warns(UserWarning, match="multiples of 16") as record:
        apply_int8(model, "switchback-global", include_attention=True)
    assert len(record) == 1
    assert "visual.transformer.resblocks.1.mlp.c_fc (72->288)" in str(record[0].message)
    vision_block, text_block = model.blocks()[0], model.blocks()[-1]
    assert type(vision_block.mlp.c_fc) is nn.Linear and type(vision_block.attn.out_proj) is nn.Linear
    assert isinstance(text_block.mlp.c_fc, SwitchBackLinear)
    assert isinstance(text_block.attn.in_proj, SwitchBackProjection)


def test_config_modes_and_openclip_names_match_the_layers():
    from bigclip.config.linear_kinds import INT8_KINDS
    from bigclip.openclip_flags import _BNB_LINEAR_ALIASES

    assert set(INT8_KINDS) == set(INT8_MODES)
    for openclip_name, mode in _BNB_LINEAR_ALIASES.items():  # --use-bnb-linear SwitchBackLinearGlobal
        assert LINEAR_CLASSES[INT8_MODES[mode]].__name__ == openclip_name


def test_bad_mode_and_backend_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="switchback-global"):
        apply_int8(create_model("tiny"), "int8")
    monkeypatch.setenv(switchback_ops.BACKEND_ENV, "cuda")
    with pytest.raises(ConfigError, match="auto, torch, triton"):
        SwitchBackLinearGlobal(16, 16)(torch.randn(2, 16))


@pytest.mark.parametrize("mode", list(INT8_MODES))
def test_apply_int8_on_meta_keeps_parameters(mode):
    model = create_model("ViT-bigG-14", device="meta")
    before = {name: (p, p.shape) for name, p in model.named_parameters()}
    assert apply_int8(model, mode, include_attention=True) is model
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    assert all(after[name] is p for name, (p, _) in before.items())  # the same Parameter objects
    cls = LINEAR_CLASSES[INT8_MODES[mode]]
    for block in model.blocks():
        assert type(block.mlp.c_fc) is cls and type(block.mlp.c_proj) is cls
        assert type(block.attn.out_proj) is cls
        assert block.attn.in_proj.quantization == INT8_MODES[mode]


def test_int8_state_dict_loads_into_plain_model():
    torch.manual_seed(0)
    model = apply_int8(create_model("tiny", device="cpu"), "switchback-vectorwise", include_attention=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    images, texts = torch.randn(4, 3, 64, 64), torch.randint(1, 1000, (4, 32))
    out = model(images, texts)
    (out["image_features"] @ out["text_features"].t()).trace().neg().backward()
    opt.step()
    plain = create_model("tiny", device="cpu", seed=1)
    plain.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        int8_features = model.encode_image(images)
        plain_features = plain.encode_image(images)
    assert torch.equal(plain.visual.proj, model.visual.proj)
    rel = (int8_features - plain_features).norm() / plain_features.norm()
    assert 0 < rel < 0.05


def test_autocast_returns_autocast_dtype_and_fp32_parameter_grads():
    layer = SwitchBackLinearGlobal(64, 32)
    x = torch.randn(2, 8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 8, 32)
    y.float().sum().backward()
    assert x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32


def test_mixed_dtypes_follow_the_activations():
    """FSDP2 mixed precision hands bf16 weights and activations; DeepSpeed may pair bf16 input, fp32 weight."""
    layer = SwitchBackLinearGlobal(64, 32)
    x = torch.randn(6, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.dtype == x.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.float32


def test_block_compiles_with_torch_compile():
    """Engines may torch.compile each block: the int8 primitives are opaque custom ops."""
    torch.manual_seed(0)
    block = apply_int8(
        create_model("tiny", device="cpu"), "switchback-global", include_attention=True
    ).blocks()[0]
    x = torch.randn(2, 17, 64, requires_grad=True)
    eager = block(x)
    eager.sum().backward()
    eager_grad, x.grad = x.grad, None
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, eager) and torch.equal(x.grad, eager_grad)


TRAIN_STEPS = 12


def _train_tiny(mode: str, steps: int) -> list[float]:
    from bigclip.ops.loss.contrastive import ClipLoss

    model = create_model("tiny", device="cpu", seed=0)
    if mode != "none":
        apply_int8(model, mode, include_attention=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    images, texts = torch.randn(32, 3, 64, 64, generator=g), torch.randint(1, 1000, (32, 32), generator=g)
    texts[:, 12] = 49407
    losses = []
    for _ in range(steps):
        out = model(images, texts)
        loss = ClipLoss()(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def fp32_losses() -> list[float]:
    return _train_tiny("none", TRAIN_STEPS)


@pytest.mark.parametrize("mode", list(INT8_MODES))
@pytest.mark.slow
def test_tiny_clip_trains_like_fp32(mode, fp32_losses):
    reference = fp32_losses
    int8 = _train_tiny(mode, TRAIN_STEPS)
    assert reference[-1] < 0.6 * reference[0]  # measured mid-descent, where the runs could drift apart
    assert int8[-1] == pytest.approx(reference[-1], rel=0.05)
    assert all(math.isfinite(v) for v in int8)
