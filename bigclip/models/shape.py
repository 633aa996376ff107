"""The model contract's static half: what a model is, described without building it and without torch.

The planner prices a run (memory, FLOPs, communication) and consolidation checks exported weights
from a `ModelShape` alone, so `bigclip plan` prices ViT-bigG-14 at 1024 GPUs without allocating
it. A model family (`ModelFamily`, looked up by --model name in families.py) produces the shape
from its config and the run's `ModelOptions`; contract.py's `param_shapes(model)` lists a built
model the same way, which is how a family's test holds its shape to its module.

  ModelShape.params   every parameter in `named_parameters()` order: name, shape, and the index
                      of its residual block in `blocks()` (-1 outside the blocks). 0-dim
                      parameters are the replicated scalars.
  ModelShape.towers   each encoder's residual stack as the activation and FLOP formulas see it
                      (`TowerShape`), keyed by tower name, in the order their blocks come in
                      `blocks()` (a linear kind's filter finds each block's tokens by it).
  ModelShape.embed_dim  the width of the features the contrastive loss compares.
  ModelShape.image_size  the side, in pixels, of the square images the model takes (the data
                      loaders resize to it; a checkpoint records it).

A tower's blocks are pre-norm residual blocks: an attention of `heads` heads (0: none) with a
fused QKV and an output projection, then an MLP of two linears (width -> mlp -> width). Those
four linears (the MLP's two; the attention's two only with --int8-attention) are what a
low-precision kind swaps (contract.py's `swappable_linears`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelFamily", "ModelOptions", "ModelShape", "ParamShape", "TowerShape"]


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    block: int  # index into the model's blocks(), or -1 outside them (embeddings, norms, projections)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TowerShape:
    layers: int
    width: int
    mlp: int  # the MLP's hidden width
    heads: int  # attention heads per block; 0: the blocks have no attention
    tokens: int  # sequence length per sample through the blocks (patch dropout applied)
    saved_outside: int = 0  # activations kept for backward outside the blocks, elements per token
    input_bytes: int = 0  # the tower's input per sample (fp32 pixels, int64 token ids)
    outside_flops: int = 0  # forward FLOPs per sample outside the blocks (patch embedding, projection)


@dataclass(frozen=True)
class ModelShape:
    towers: dict[str, TowerShape]
    params: tuple[ParamShape, ...]
    embed_dim: int
    image_size: int

    @property
    def hidden_width(self) -> int:
        """The widest residual stream (the runtime contract's `hidden_width`)."""
        return max(t.width for t in self.towers.values())

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True)
class ModelOptions:
    """The run's options that change what a model name builds (0 / False: the config's own value)."""

    patch_dropout: float = 0.0  # --force-patch-dropout: fewer image tokens through the blocks
    image_size: int = 0  # --force-image-size
    context_length: int = 0  # --force-context-length
    quick_gelu: bool = False  # --force-quick-gelu (no change of shape; exported configs record it)
    loss: str = "clip"  # the contrastive loss: "siglip" learns a bias beside the logit scale
    cache_dir: str = ""  # where an hf-hub:ORG/REPO model's config is cached (--cache-dir)


@dataclass(frozen=True)
class ModelFamily:
    """A kind of model `--model` names: which names it owns, how it describes them, and how a run
    checks its flags, builds it and tokenizes its texts. Torch-free: the builder is named, not held."""

    name: str
    configs: Callable[[], list[str]]  # the names it bundles (`bigclip models`, messages)
    owns: Callable[[str], bool]  # whether a --model name is one of its models
    shape: Callable[[str, ModelOptions], ModelShape]
    # "module:function", imported when a run builds a model: function(model_cfg, options, *,
    # device, seed) returns the model (the contract's nn.Module; on the meta device its weights are
    # left to the engine) with the family's own model flags applied (checkpointing, locks).
    build: str
    # bigclip.data.tokenizer.build_tokenizer's keyword arguments for a name: what its text tower reads.
    tokenizer: Callable[[str, ModelOptions], dict[str, Any]]
    # Refuses (ConfigError, at parse time, torch-free) the flags of a run's ModelConfig that this
    # family cannot honour for its --model: --pretrained tags, --force-* sizes, checkpointing, locks.
    # (Typed Any: config/ imports this module to check a run's flags.)
    check: Callable[[Any], None]
    # OpenCLIP's `model_cfg` for a name (`bigclip consolidate --open-clip-dir`); None: OpenCLIP
    # has no such model, so its weights export as safetensors only.
    open_clip_config: Callable[[str, ModelOptions], dict[str, Any]] | None = None
    other_names: str = ""  # names it takes beyond its configs, for messages (e.g. hf-hub:ORG/REPO)
    # Whether a parameter (by name) is the image tower's, for `bigclip models`' image/text split.
    image_param: Callable[[str], bool] = lambda name: name.startswith("visual.")  # OpenCLIP's layout
    # A module for weights a run names rather than gives (tags, models that bring their own),
    # imported when a run starts: `weights_of(model_config)` ((file, label) or None: --pretrained
    # is a path or URI) and `apply_preprocess(train_config, log)` (the named weights' image
    # mean/std). "": --pretrained takes paths and URIs only. CLIP's: OpenCLIP's tags and hf-hub:.
    named_weights: str = ""
    # Whether a --model name brings its own weights (a run starts from them without --pretrained).
    has_own_weights: Callable[[str], bool] = lambda name: False
    # For the message of a --model no family owns: what this family makes of --pretrained (CLIP's:
    # the models that have it as an OpenCLIP tag); "" when nothing.
    pretrained_hint: Callable[[str], str] = lambda pretrained: ""
