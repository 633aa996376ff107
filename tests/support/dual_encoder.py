"""A dual encoder that is not CLIP and implements the model contract and nothing more: both halves,
the runtime one (contract.py, for engines and linear kinds) and the static one (a `ModelFamily`
with its `ModelShape`, for the planner and consolidation), and the family's builder, tokenizer and
flag check, through which `--model dual-encoder-tiny` trains once the family is registered.
tests/test_model_contract.py trains, plans and consolidates it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bigclip.config.model import ModelConfig
from bigclip.errors import ConfigError
from bigclip.models.contract import InitFn, LinearSlot, ScalarRange
from bigclip.models.shape import ModelFamily, ModelOptions, ModelShape, ParamShape, TowerShape

NAME = "dual-encoder-tiny"
PATCH, WIDTH, LAYERS, VOCAB = 8, 32, 2, 50000
IMAGE_SIZE, CONTEXT = 64, 32  # what tests/support/engine_harness.py's batches hold


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
        self.token_embed = nn.Embedding(VOCAB, WIDTH, device=device)
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


# The static contract: the shape the planner and consolidation read, without building the module.


def _block_params(prefix: str, first: int) -> list[ParamShape]:
    shapes = {"norm.weight": (WIDTH,), "norm.bias": (WIDTH,), "mlp.c_fc.weight": (4 * WIDTH, WIDTH),
              "mlp.c_fc.bias": (4 * WIDTH,), "mlp.c_proj.weight": (WIDTH, 4 * WIDTH), "mlp.c_proj.bias": (WIDTH,)}  # fmt: skip
    return [ParamShape(f"{prefix}.{i}.{n}", s, first + i) for i in range(LAYERS) for n, s in shapes.items()]


def dual_encoder_shape(name: str, options: ModelOptions) -> ModelShape:
    patches = (IMAGE_SIZE // PATCH) ** 2
    image = TowerShape(LAYERS, WIDTH, 4 * WIDTH, heads=0, tokens=patches, input_bytes=3 * IMAGE_SIZE**2 * 4,
                       outside_flops=2 * 3 * PATCH**2 * WIDTH * patches)  # fmt: skip
    text = TowerShape(LAYERS, WIDTH, 4 * WIDTH, heads=0, tokens=CONTEXT, input_bytes=CONTEXT * 8)
    params = (
        [ParamShape("temperature", (), -1), ParamShape("patch_embed.weight", (WIDTH, 3 * PATCH**2), -1),
         ParamShape("patch_embed.bias", (WIDTH,), -1), ParamShape("token_embed.weight", (VOCAB, WIDTH), -1)]
        + _block_params("image_blocks", 0) + _block_params("text_blocks", LAYERS)
    )  # fmt: skip
    return ModelShape(
        towers={"image": image, "text": text}, params=tuple(params), embed_dim=WIDTH, image_size=IMAGE_SIZE
    )


def build(model: ModelConfig, options: ModelOptions, *, device: torch.device | str, seed: int) -> DualEncoder:
    return DualEncoder(device=device)  # on a real device the engine initialises it (`initial_values`)


def check(model: ModelConfig) -> None:
    """Its one config has no options: the flags that would change it are refused, not ignored."""
    if model.grad_checkpointing or model.lock_image or model.lock_text or model.pretrained:
        raise ConfigError(f"--model {NAME} takes no --grad-checkpointing, --lock-* or --pretrained")
    if model.force_image_size or model.force_context_length or model.force_patch_dropout:
        raise ConfigError(f"--model {NAME} has one size: drop the --force-* options")


FAMILY = ModelFamily(
    name="dual-encoder", configs=lambda: [NAME], owns=lambda n: n == NAME, shape=dual_encoder_shape,
    build="support.dual_encoder:build", tokenizer=lambda name, options: {"context_length": CONTEXT, "vocab_size": VOCAB},
    check=check, image_param=lambda name: name.startswith(("patch_embed.", "image_blocks.")),
)  # fmt: skip
