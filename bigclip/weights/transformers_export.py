"""`bigclip consolidate SRC --transformers-dir DIR`: a folder Hugging Face transformers loads as

    model = transformers.CLIPModel.from_pretrained(DIR)          # and CLIPProcessor.from_pretrained(DIR)

with the image and text features of bigclip's model (`get_image_features`, `get_text_features`
equal `encode_image`, `encode_text` on the same inputs). DIR holds:
  config.json                  transformers' CLIPConfig: each tower's width, depth, heads, MLP width and
                               activation (gelu; quick_gelu for -quickgelu models), image, patch and
                               context size, vocabulary, projection dim; written last (the commit)
  model.safetensors            the weights under transformers' names (with --max-shard-size: shards and
                               model.safetensors.index.json, transformers' layout), and their checksum
                               manifest (model.manifest.json)
  vocab.json, merges.txt, ...  OpenCLIP's tokenizer as CLIPTokenizer files (hf_tokenizer_files.py)
  preprocessor_config.json     CLIPImageProcessor: the run's shortest-side resize, centre crop, mean, std
The names are those of transformers' convert_clip_original_pytorch_to_hf.py, read backwards (OpenCLIP's
layout is OpenAI's): `visual.*` -> `vision_model.*` (conv1 -> embeddings.patch_embedding, ln_pre ->
pre_layrnorm, ln_post -> post_layernorm), the root's text tower -> `text_model.*`, each residual block's
ln_1/ln_2 -> layer_norm1/2, mlp.c_fc/c_proj -> mlp.fc1/fc2, and the fused attn.in_proj_weight/bias
split by rows into self_attn.q/k/v_proj (contiguous row ranges: streamed as they are); `visual.proj`
and `text_projection` ([width, dim], used as x @ P) become the [dim, width] weights of
visual_projection and text_projection (the only tensors held whole, to transpose them). Text features
are pooled where the end-of-text id (49407) first appears, as OpenCLIP pools at the highest id.
Refused, in one line, before anything is written: layouts CLIPModel cannot hold (SigLIP's learned
logit bias, which CLIPModel has no place for; a model family other than CLIP), and weights trained
with bigclip's hashing tokenizer (CLIPTokenizer's ids would mean nothing to their text tower).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bigclip.errors import ConfigError, StorageError
from bigclip.models.families import family_of
from bigclip.storage.locations import open_location
from bigclip.weights.dcp_reader import TensorInfo
from bigclip.weights.hf_tokenizer_files import tokenizer_files
from bigclip.weights.open_clip_export import ExportedWeights, free_folder, model_config, preprocess_config
from bigclip.weights.safetensors_writer import OutputPlan, WriteResult, plan_output, write_safetensors
from bigclip.weights.sources import WeightSource

CONFIG_NAME = "config.json"
PREPROCESSOR_NAME = "preprocessor_config.json"
BOS, EOS = 49406, 49407  # OpenCLIP's start and end of text: CLIPTokenizer's <|startoftext|>, <|endoftext|>
BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
         "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}  # fmt: skip
FIXED = {
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "logit_scale": "logit_scale",
    **{
        f"visual.{ln}.{p}": f"vision_model.{hf}.{p}"
        for ln, hf in (("ln_pre", "pre_layrnorm"), ("ln_post", "post_layernorm"))
        for p in ("weight", "bias")
    },  # fmt: skip
    **{f"ln_final.{p}": f"text_model.final_layer_norm.{p}" for p in ("weight", "bias")},
}
TRANSPOSED = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}
_BLOCK_NAME = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)")
_IN_PROJ = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)")


def hf_targets(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' (name, shape) for one OpenCLIP tensor: one, or q, k, v for a fused projection;
    a ConfigError for a tensor CLIPModel has no place for."""
    if name in FIXED:
        return [(FIXED[name], shape)]
    if name in TRANSPOSED:
        return [(TRANSPOSED[name], (shape[1], shape[0]))]
    fused = _IN_PROJ.fullmatch(name)
    if fused:
        tower, layer, kind = fused.groups()
        prefix = f"{'vision' if tower else 'text'}_model.encoder.layers.{layer}.self_attn"
        part = (shape[0] // 3, *shape[1:])
        return [(f"{prefix}.{q}_proj.{kind}", part) for q in "qkv"]
    block = _BLOCK_NAME.fullmatch(name)
    if block and block.group(3) in BLOCK:
        tower, layer, module, kind = block.groups()
        return [
            (f"{'vision' if tower else 'text'}_model.encoder.layers.{layer}.{BLOCK[module]}.{kind}", shape)
        ]
    if name == "logit_bias":
        raise ConfigError(
            "the weights hold a learned logit bias (a SigLIP model), which transformers' CLIPModel has no place "
            "for: export it with --open-clip-dir (OpenCLIP loads it) or to a .safetensors file"
        )
    raise ConfigError(f"{name} {list(shape)}: transformers' CLIPModel has no place for this tensor; "
                      "export with --open-clip-dir or to a .safetensors file instead")  # fmt: skip


def regroup(
    pieces: Iterator[tuple[TensorInfo, torch.Tensor]], groups: list[tuple[TensorInfo, str, list[TensorInfo]]]
) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """The pieces of each group's source tensor (the groups in stream order: the source, its OpenCLIP
    name, its outputs) cut at its outputs' boundaries, or gathered and transposed for a projection:
    what the writer takes, one output tensor after another."""
    stream = iter(pieces)
    for source, name, outputs in groups:
        if name in TRANSPOSED:
            whole = torch.cat([p.clone() for p in _pieces_of(stream, source)]).view(source.shape)
            yield source, whole.t().contiguous().view(-1)
            continue
        sizes = [o.numel for o in outputs]
        left = sizes.pop(0)
        for piece in _pieces_of(stream, source):
            while piece.numel():
                part, piece = piece[:left], piece[left:]
                yield source, part
                left -= part.numel()
                if left == 0 and sizes:
                    left = sizes.pop(0)


def _pieces_of(
    stream: Iterator[tuple[TensorInfo, torch.Tensor]], source: TensorInfo
) -> Iterator[torch.Tensor]:
    left = source.numel
    while left:
        info, piece = next(stream)
        if info.name != source.name or piece.numel() > left:
            raise StorageError(
                f"{source.name}: the source's pieces do not add up to its shape {source.shape}"
            )
        left -= piece.numel()
        yield piece


def hf_config(
    model_cfg: dict[str, Any], weights: dict[str, tuple[int, ...]], *, dtype: str
) -> dict[str, Any]:
    """transformers' CLIPConfig for an OpenCLIP `model_cfg` (sizes from the weights' own shapes)."""
    v, t = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    act = "quick_gelu" if model_cfg.get("quick_gelu") else "gelu"  # nn.GELU is exact: transformers' "gelu"
    dim = model_cfg["embed_dim"]
    vision = {
        "model_type": "clip_vision_model", "hidden_size": v["width"], "num_hidden_layers": v["layers"],
        "intermediate_size": weights["visual.transformer.resblocks.0.mlp.c_fc.weight"][0],
        "num_attention_heads": v["width"] // v["head_width"], "image_size": v["image_size"],
        "patch_size": v["patch_size"], "num_channels": 3, "hidden_act": act, "layer_norm_eps": 1e-5,
        "projection_dim": dim,
    }  # fmt: skip
    text = {
        "model_type": "clip_text_model", "hidden_size": t["width"], "num_hidden_layers": t["layers"],
        "intermediate_size": weights["transformer.resblocks.0.mlp.c_fc.weight"][0],
        "num_attention_heads": t["heads"], "vocab_size": t["vocab_size"],
        "max_position_embeddings": t["context_length"], "hidden_act": act, "layer_norm_eps": 1e-5,
        "projection_dim": dim, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": EOS,
    }  # fmt: skip
    torch_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    return {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": dim,
            "logit_scale_init_value": 2.6592, "initializer_factor": 1.0, "torch_dtype": torch_dtype,
            "text_config": text, "vision_config": vision}  # fmt: skip


def image_processor_config(run: dict[str, Any], image_size: int) -> dict[str, Any] | None:
    """CLIPImageProcessor's settings for the run's evaluation transform; None where it cannot do that
    transform (a longest-side or squashing resize)."""
    pre = preprocess_config(run)
    if pre["resize_mode"] != "shortest":
        return None
    return {
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": image_size},
        "resample": 2 if pre["interpolation"] == "bilinear" else 3, "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": pre["mean"], "image_std": pre["std"], "do_convert_rgb": True,
    }  # fmt: skip


@dataclass
class TransformersExport:
    """What `--transformers-dir` writes, all checked (`prepare`) before a byte moves (`write`)."""

    folder: str
    plan: OutputPlan
    groups: list[tuple[TensorInfo, str, list[TensorInfo]]]  # (source tensor, OpenCLIP name, outputs)
    files: dict[str, bytes]  # the tokenizer's and image processor's, then config.json
    metadata: dict[str, str]
    manifest: dict[str, Any]
    overwrite: bool

    def write(
        self, pieces: Iterator[tuple[TensorInfo, torch.Tensor]], *, on_bytes: Any = lambda n: None
    ) -> WriteResult:
        """`pieces`: the source tensors' bytes, in `groups` order (see consolidate.py)."""
        result = write_safetensors(self.plan, regroup(pieces, self.groups), metadata=self.metadata,
                                   manifest=self.manifest, overwrite=self.overwrite, on_bytes=on_bytes)  # fmt: skip
        location = open_location(self.folder)
        for file_name, data in self.files.items():  # config.json last: the commit
            location.write_bytes(file_name, data)
        return result


# What CLIPModel computes: ln_pre, class-token pooling, a causal text tower pooled at the end of
# text (the highest id), CLIP's tokenizer; no layer scale.
CLIP_MODEL_HAS = {
    "vision_cfg": {
        "pool_type": "tok",
        "no_ln_pre": False,
        "final_ln_after_pool": False,
        "ls_init_value": None,
    },
    "text_cfg": {
        "pool_type": "argmax",
        "no_causal_mask": False,
        "hf_tokenizer_name": "",
        "ls_init_value": None,
    },
}


def options_clip_model_lacks(model_cfg: dict[str, Any]) -> list[str]:
    return [
        f"{tower}.{key} {model_cfg[tower][key]!r}"
        for tower, defaults in CLIP_MODEL_HAS.items()
        for key, value in defaults.items()
        if model_cfg[tower].get(key, value) != value
    ]


def prepare(
    source: WeightSource, pairs: list[tuple[TensorInfo, TensorInfo]], folder: str, *, model: str = "",
    dtype: str, overwrite: bool = False, max_shard_bytes: int = 0,
) -> TransformersExport:  # fmt: skip
    """Check that CLIPModel can hold the consolidation's (source tensor, OpenCLIP-named output) pairs
    and plan DIR; a ConfigError or StorageError, and nothing written, otherwise."""
    exported = ExportedWeights.check(
        source, model, ids="transformers' CLIPTokenizer gives OpenCLIP's BPE ids, which"
    )
    run, name = exported.run, exported.model
    family = family_of(name)
    if family.name != "clip":
        raise ConfigError(f"model {name} ({family.name} family) is not CLIP's layout, which is all transformers' "
                          "CLIPModel holds: export it to a .safetensors file instead")  # fmt: skip
    groups = [(s, o.name, [TensorInfo(n, o.dtype, shape) for n, shape in hf_targets(o.name, tuple(o.shape))])
              for s, o in pairs]  # fmt: skip
    weights = {o.name: tuple(o.shape) for _, o in pairs}
    model_cfg = model_config(name, run, weights)  # checks every weight's shape against the family's
    if options := options_clip_model_lacks(model_cfg):
        raise ConfigError(f"model {name} has OpenCLIP options transformers' CLIPModel does not: {', '.join(options)}; "
                          "export it with --open-clip-dir or to a .safetensors file instead")  # fmt: skip
    config = hf_config(model_cfg, weights, dtype=dtype)
    config["bigclip"] = exported.record()
    files = tokenizer_files(context_length=model_cfg["text_cfg"]["context_length"])
    processor = image_processor_config(run, model_cfg["vision_cfg"]["image_size"])
    if processor is not None:
        files[PREPROCESSOR_NAME] = json.dumps(processor, indent=2).encode()
    files[CONFIG_NAME] = json.dumps(config, indent=2).encode()
    free_folder(folder, files, overwrite=overwrite)
    plan = plan_output(folder, [t for _, _, outs in groups for t in outs], max_shard_bytes=max_shard_bytes)
    tensors = sum(len(outs) for _, _, outs in groups)
    manifest = {**exported.manifest(dtype, tensors), "layout": "transformers CLIPModel"}
    return TransformersExport(folder, plan, groups, files, exported.metadata(dtype), manifest, overwrite)
