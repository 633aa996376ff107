"""The fp8 linear kinds (torchao float8, emulated on CPU): what they swap, how close they stay to the
16-bit path, and a run through save, resume and consolidation.

On a CPU torchao emulates the float8 GEMMs (the same casts and scales, a high-precision matmul),
so these tests check the numerics and the plumbing; the speed is a GPU benchmark's
(benchmarks/step_variants_gpu.py).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from safetensors.torch import load_file
from support.engine_harness import global_batch, tiny_config
from support.train_harness import demo_argv, train_and_weights

from bigclip.cli import main as cli
from bigclip.distributed import spawn
from bigclip.errors import ConfigError
from bigclip.models.factory import create_model
from bigclip.models.from_config import build_model
from bigclip.ops.loss.contrastive import build_loss

torchao = pytest.importorskip("torchao", reason="the fp8 kinds need torchao (bigclip[fp8], in .[dev])")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from bigclip.ops.fp8.float8 import Float8Projection, apply_fp8  # noqa: E402

RECIPES = ("tensorwise", "rowwise")


def test_the_kind_swaps_every_block_linear_and_keeps_every_parameter():
    plain = build_model(tiny_config(), device="cpu")
    fp8 = build_model(tiny_config(**{"model.linear_kind": "fp8-tensorwise"}), device="cpu")
    assert {k: v.shape for k, v in fp8.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    for block in fp8.blocks():
        assert all(
            isinstance(m, Float8Linear) for m in (block.mlp.c_fc, block.mlp.c_proj, block.attn.out_proj)
        )
        assert isinstance(block.attn.in_proj, Float8Projection)
    assert not isinstance(fp8.visual.proj, Float8Linear) and type(fp8.text_projection) is torch.nn.Parameter


def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and fp32 gradients of one batch, the inputs in the model's dtype."""
    images, texts = global_batch(0, 8)
    out = model(images.to(model.logit_scale.dtype), texts)
    features = (out["image_features"].float(), out["text_features"].float(), out["logit_scale"].float())
    loss = build_loss(tiny_config().loss)(*features)
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def gradient_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each parameter's gradient error relative to the reference's norm, sorted."""
    return torch.stack([(grads[n] - g).norm() / g.norm() for n, g in reference.items()]).sort().values


@pytest.mark.parametrize("recipe", RECIPES)
def test_numerics_stay_within_fp8_rounding_of_the_16bit_path(recipe):
    """Against fp32: the fp8 run's gradient errors stay within 2^4 of a pure-bf16 run's (e4m3 keeps 3
    mantissa bits, bf16 7: 16x the per-element rounding, in the swapped linears only); a wrong scale
    or layout would be off by the whole gradient. And the fp8 run is not the fp32 one."""
    torch.manual_seed(0)
    plain = create_model("tiny", device="cpu")
    fp8 = apply_fp8(copy.deepcopy(plain), recipe, emulate=True)
    loss, grads = loss_and_grads(plain)
    loss8, grads8 = loss_and_grads(fp8)
    loss16, grads16 = loss_and_grads(copy.deepcopy(plain).to(torch.bfloat16))
    err8, err16 = gradient_errors(grads8, grads), gradient_errors(grads16, grads)
    assert err8.median() <= 16 * err16.median() and err8.max() <= 16 * err16.max(), (err8, err16)
    assert abs(loss8 - loss) <= 16 * abs(loss16 - loss) + 1e-3 * loss
    swapped = [n for n in grads if ".mlp.c_fc." in n or ".attn.in_proj_weight" in n]
    assert swapped and all(not torch.equal(grads8[n], grads[n]) for n in swapped)  # the float8 path ran


def test_int8_attention_with_fp8_is_refused_saying_what_to_do():
    with pytest.raises(ConfigError, match="fp8 kinds always include the attention projections"):
        tiny_config(**{"model.linear_kind": "fp8-rowwise", "model.int8_attention": True})


@pytest.mark.dist
def test_fp8_run_saves_resumes_and_consolidates_to_plain_weights(demo_data, tmp_path):
    """Two ranks train with fp8 linears and save; a resumed run continues from the saved step; the
    consolidated checkpoint loads into a plain 16-bit model, parameter for parameter."""
    ckpt = tmp_path / "ckpt"
    argv = ["--linear-kind", "fp8-tensorwise", "--save-every-n-steps", "4", "--checkpoint-dir", str(ckpt)]
    first = spawn(train_and_weights, 2, demo_argv(demo_data, tmp_path, "--max-steps", "8", *argv, name="a"))
    first = first[0]
    assert first["step"] == 8 and math.isfinite(first["loss"])
    resumed = spawn(train_and_weights, 2, demo_argv(
        demo_data, tmp_path, "--max-steps", "12", *argv, "--resume", "latest", name="a"))[0]  # fmt: skip
    assert resumed["step"] == 12 and math.isfinite(resumed["loss"])
    out = tmp_path / "fp8.safetensors"
    assert cli(["consolidate", str(ckpt), str(out), "--no-progress"]) == 0
    state = load_file(out)
    assert state.keys() == resumed["weights"].keys()
    for key, value in resumed["weights"].items():
        assert torch.equal(state[key], value), key
    create_model("tiny", device="cpu").load_state_dict(state, strict=True)
