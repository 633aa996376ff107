"""Loss and int8 kernels on CUDA (marker `gpu`: skipped without CUDA, never on CI; one GPU).

Chunked CLIP and SigLIP losses on CUDA against the float64 reference of test_contrastive.py:
fp32 features to the CPU tests' 1e-5; bf16 features (the CUDA branch: bf16 tensor-core tiles
with fp32 output) against the reference computed from the same bf16 values: bf16 x bf16
products are exact in fp32 and accumulate in fp32, so the loss agrees to 1e-4, and the
gradients, returned in bf16 (8 bits of mantissa), to 1e-2 of their largest value.
SwitchBack: the compiled Triton kernels against the torch._int_mm path, on the same int8
operands: int32 products bit-identical; whole layers (forward and backward) bit-identical too,
each backend on its own copy of the layer (tests/support/switchback_selfcheck.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_contrastive import Inputs, assert_matches, make_inputs, reference, run_loss

from bigclip.ops.loss.chunked import TileMatmul
from bigclip.ops.loss.contrastive import ChunkedContrastiveLoss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def on(inputs: Inputs, dtype: torch.dtype) -> Inputs:
    return Inputs(
        *(t.to("cuda", dtype) for t in (inputs.image, inputs.text)), inputs.scale.cuda(), inputs.bias.cuda()
    )


def to_cpu(result):
    return type(result)(result.loss, result.image.cpu(), result.text.cpu(), result.scale, result.bias)


@pytest.mark.parametrize("exchange", ["ring", "allgather"])
@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize(("n", "chunk"), [(300, 64), (1024, 256), (77, 1000)])
def test_chunked_losses_on_cuda_match_float64(kind, exchange, n, chunk):
    inputs = make_inputs(n, dim=64, seed=n)
    loss_fn = ChunkedContrastiveLoss(kind=kind, chunk_size=chunk, exchange=exchange)
    got = run_loss(loss_fn, *on(inputs, torch.float32).rows(0, 1), on(inputs, torch.float32))
    assert_matches(to_cpu(got), reference(inputs, 1, kind)[0])


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_bf16_features_use_fp32_output_tiles_and_match_float64(kind):
    inputs = make_inputs(2048, dim=128, seed=7)
    rounded = Inputs(
        inputs.image.bfloat16().float(), inputs.text.bfloat16().float(), inputs.scale, inputs.bias
    )
    cuda = on(rounded, torch.bfloat16)
    got = run_loss(ChunkedContrastiveLoss(kind=kind, chunk_size=512), cuda.image, cuda.text, cuda)
    assert TileMatmul(cuda.image).low == torch.bfloat16  # the tensor-core branch, not an fp32 upcast
    want = reference(rounded, 1, kind)[0]
    assert got.loss == pytest.approx(want.loss, rel=1e-4)
    for name in ("image", "text"):
        expected = getattr(want, name)
        torch.testing.assert_close(
            getattr(got, name).cpu(), expected, rtol=0, atol=1e-2 * expected.abs().max().item()
        )
    assert got.scale == pytest.approx(want.scale, rel=1e-2, abs=1e-4)


@needs_triton
def test_triton_int8_matmul_is_bit_identical_to_torch_int_mm():
    from bigclip.ops.int8 import kernels, torch_path

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in [(64, 96, 128), (4096, 1664, 8192), (300, 200, 520)]:
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
        assert torch.equal(kernels.int8_matmul_int32(a, b), torch_path.int8_matmul_int32(a, b)), (m, n, k)


@needs_triton
@pytest.mark.parametrize("quantization", ["global", "vectorwise", "memefficient"])
@pytest.mark.parametrize("call", ["bf16", "amp_bf16"])
def test_switchback_layer_on_triton_matches_the_int_mm_path(quantization, call):
    """Forward and backward at ViT-H-14's MLP size (4096 tokens, 1280 -> 5120). Each backend runs
    its own copy of the nn.Linear (`from_linear` keeps the Linear's Parameters: a shared one
    would add the first run's weight and bias gradients to the second's). Same int8 operands,
    same int32 sums, same fp32 epilogue order: y and all three gradients bit for bit; a failure
    names the tensor and the size of the difference."""
    from support.switchback_selfcheck import LayerCase, check_layer, failures

    dtypes = {"param_dtype": torch.float32, "autocast": torch.bfloat16} if call == "amp_bf16" else {}
    layout = "transposed" if call == "amp_bf16" else "contiguous"
    case = LayerCase(quantization, (16, 256), 1280, 5120, grad_layout=layout, **dtypes)
    rows = check_layer(case, torch.device("cuda"))
    assert not failures(rows), failures(rows)
