"""The model contract (bigclip/models/contract.py) is all an engine or a linear kind needs: a dual
encoder that is not CLIP, implementing the contract and nothing more, trains on FSDP2 and ZeRO-3
over two gloo ranks to the same losses, and takes the fp8 and int8 linear kinds."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.engine_harness import run_steps, tiny_config
from torch import nn

from bigclip.distributed import Runtime, spawn
from bigclip.engines import build_engine
from bigclip.models.contract import InitFn, LinearSlot, ScalarRange, TrainableModel

os.environ["DS_ACCELERATOR"] = "cpu"
DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
PATCH, WIDTH, LAYERS = 8, 32, 2


class MLPBlock(nn.Module):
    def __init__(self, width: int, device: torch.device | str | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, device=device)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(width, 4 * width, device=device))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(4 * width, width, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class DualEncoder(nn.Module):
    """Patches and tokens through residual MLP blocks (no attention), mean-pooled: not CLIP."""

    def __init__(self, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(3 * PATCH * PATCH, WIDTH, device=device)
        self.token_embed = nn.Embedding(50000, WIDTH, device=device)
        self.image_blocks = nn.ModuleList(MLPBlock(WIDTH, device) for _ in range(LAYERS))
        self.text_blocks = nn.ModuleList(MLPBlock(WIDTH, device) for _ in range(LAYERS))
        self.temperature = nn.Parameter(torch.empty((), device=device))

    def forward(self, images: torch.Tensor | None, texts: torch.Tensor | None) -> dict:
        out = {"logit_scale": self.temperature.exp()}
        if images is not None:
            x = self.patch_embed(F.unfold(images.to(self.input_dtype), PATCH, stride=PATCH).transpose(1, 2))
            for block in self.image_blocks:
                x = block(x)
            out["image_features"] = F.normalize(x.mean(1), dim=-1)
        if texts is not None:
            x = self.token_embed(texts)
            for block in self.text_blocks:
                x = block(x)
            out["text_features"] = F.normalize(x.mean(1), dim=-1)
        return out

    # The model contract.
    def blocks(self) -> list[nn.Module]:
        return [*self.image_blocks, *self.text_blocks]

    def param_initializers(self) -> dict[str, InitFn]:
        def init(name: str) -> InitFn:
            if name == "temperature":
                return lambda t, g: t.fill_(math.log(10))
            if name.endswith("bias"):
                return lambda t, g: t.zero_()
            if ".norm." in name:
                return lambda t, g: t.fill_(1.0)
            return lambda t, g: t.normal_(0.0, 0.05, generator=g)

        return {name: init(name) for name, _ in self.named_parameters()}

    @property
    def input_dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    @property
    def hidden_width(self) -> int:
        return WIDTH

    def replicated_scalars(self) -> dict[str, ScalarRange]:
        return {"temperature": (0.0, math.log(100))}

    def swappable_linears(self) -> list[LinearSlot]:
        names = {id(m): n for n, m in self.named_modules()}
        return [
            LinearSlot(
                f"{names[id(b)]}.mlp.{a}",
                b.mlp,
                a,
                "mlp",
                in_features=getattr(b.mlp, a).in_features,
                out_features=getattr(b.mlp, a).out_features,
            )  # fmt: skip
            for b in self.blocks()
            for a in ("c_fc", "c_proj")
        ]


def engine_config(engine: str, **overrides: object):  # noqa: ANN201
    if engine != "fsdp":
        overrides |= {
            "engine.engine": "deepspeed",
            "engine.deepspeed_config": str(DS_CONFIGS / f"{engine}.json"),
        }
    return tiny_config(**overrides)


def train(rank: int, world: int, engine: str, linear_kind: str = "none") -> list[float]:
    """Worker: the dual encoder through the real engine, 4 optimizer steps."""
    cfg = engine_config(engine)
    runtime = Runtime(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    built = build_engine(cfg, runtime)

    def make(device: torch.device | str) -> DualEncoder:
        model = DualEncoder(device=device)
        if linear_kind.startswith("fp8"):
            from bigclip.ops.fp8.float8 import apply_fp8

            apply_fp8(model, linear_kind.removeprefix("fp8-"), emulate=True)
        elif linear_kind != "none":
            from bigclip.ops.int8.switchback import apply_int8

            apply_int8(model, linear_kind)
        return model

    built.build(make("meta"), rebuild=make)
    return run_steps(built, cfg, range(4), 8)


def test_the_dual_encoder_implements_the_contract():
    assert isinstance(DualEncoder(device="meta"), TrainableModel)


@pytest.mark.dist
def test_a_model_that_is_not_clip_trains_the_same_on_fsdp2_and_zero3():
    fsdp = spawn(train, 2, "fsdp")[0]
    zero3 = spawn(train, 2, "zero3")[0]
    assert all(math.isfinite(x) for x in fsdp) and len(set(fsdp)) == len(fsdp), fsdp  # it trained
    assert zero3 == pytest.approx(fsdp, rel=1e-4)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["fp8-tensorwise", "switchback-global"])
def test_a_model_that_is_not_clip_takes_the_linear_kinds(kind):
    if kind.startswith("fp8"):
        pytest.importorskip("torchao")
    plain, swapped = spawn(train, 1, "fsdp")[0], spawn(train, 1, "fsdp", kind)[0]
    assert all(math.isfinite(x) for x in swapped) and swapped != plain
    assert swapped == pytest.approx(plain, rel=0.05)
