"""`bigclip consolidate SRC --open-clip-dir DIR`: the folder OpenCLIP's `local-dir:` loader reads
and its `push_to_hf_hub` writes, so

    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:DIR")
    tokenizer = open_clip.get_tokenizer("local-dir:DIR")

work with no network, and DIR can be uploaded to the Hugging Face Hub as it is. DIR holds:
  open_clip_model.safetensors   the weights under OpenCLIP's names (one file: the loader reads one)
  open_clip_config.json         {"model_cfg": OpenCLIP's model config, "preprocess_cfg": mean, std,
                                interpolation, resize mode}, plus where the weights came from and
                                the tokenizer they were trained with
  vocab.json, merges.txt, ...   that tokenizer in Hugging Face's format, as push_to_hf_hub uploads it
The model config is the run's (--model, and its --force-* overrides when the checkpoint saved
its config), from the model's family, and checked against every weight's shape in the family's
static shape (models/shape.py) before anything is written; a family OpenCLIP has no config for
is refused. Weights trained
with another tokenizer (bigclip's opt-in hashing one) are refused: OpenCLIP tokenizes differently, so its ids would
mean nothing to the text tower. The config file is written last: a folder without it is not
an export (OpenCLIP's loader needs it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bigclip.config.data import channel_values
from bigclip.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from bigclip.errors import ConfigError, StorageError
from bigclip.models.families import family_of
from bigclip.models.shape import ModelOptions, ModelShape
from bigclip.storage.locations import Location, open_location
from bigclip.weights.dcp_reader import TensorInfo
from bigclip.weights.hf_tokenizer_files import model_tokenizer_files
from bigclip.weights.safetensors_writer import WriteResult, plan_output, write_safetensors
from bigclip.weights.sources import WeightSource, weights_tokenizer

CONFIG_NAME, WEIGHTS_NAME = "open_clip_config.json", "open_clip_model.safetensors"
OPENCLIP_TOKENIZER = "open_clip"


def saved_run_config(source: WeightSource) -> dict[str, Any]:
    """The resolved config a bigclip checkpoint saved ({} for other sources)."""
    reader = source.reader
    if source.kind != "dcp" or "train.config" not in reader.value_keys("train."):
        return {}
    return json.loads(reader.read_value("train.config"))


def model_config(name: str, run: dict[str, Any], weights: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """OpenCLIP's `model_cfg` for the weights: the model family's, for the named config with the
    run's --force-* options (a learned logit bias: SigLIP), checked against the family's shape."""
    model = run.get("model", {})
    size = model.get("force_image_size") or 0
    options = ModelOptions(
        quick_gelu=bool(model.get("force_quick_gelu")),
        image_size=size[0] if isinstance(size, list) else int(size),
        context_length=int(model.get("force_context_length") or 0),
        loss="siglip" if "logit_bias" in weights else "clip",
    )
    family = family_of(name)
    if family.open_clip_config is None:
        raise ConfigError(
            f"model {name} ({family.name} family) has no OpenCLIP config, so OpenCLIP cannot load it: "
            "consolidate it to a .safetensors file instead of --open-clip-dir"
        )
    check_shapes(family.shape(name, options), weights, name=name)
    return family.open_clip_config(name, options)


def check_shapes(shape: ModelShape, weights: dict[str, tuple[int, ...]], *, name: str) -> None:
    expected = {p.name: p.shape for p in shape.params}
    wrong = [f"{n}: weights {weights.get(n)}, config {s}" for n, s in expected.items() if weights.get(n) != s]
    wrong += [f"{n}: not in model {name}" for n in weights if n not in expected]
    if wrong:
        raise ConfigError(
            f"the weights do not fit OpenCLIP's config for {name}:\n  " + "\n  ".join(wrong[:20])
            + "\n(pass --model NAME if the checkpoint does not say which model it holds)"
        )  # fmt: skip


def preprocess_config(run: dict[str, Any]) -> dict[str, Any]:
    """What push_to_hf_hub records from the model's transforms: bigclip's evaluation transform
    (bicubic resize of the shortest side, centre crop) with the run's mean and std."""
    data = run.get("data", {})
    return {
        "mean": list(channel_values(data.get("image_mean") or [], OPENAI_CLIP_MEAN, flag="--image-mean")),
        "std": list(channel_values(data.get("image_std") or [], OPENAI_CLIP_STD, flag="--image-std")),
        "interpolation": data.get("image_interpolation") or "bicubic",
        "resize_mode": data.get("image_resize_mode") or "shortest",
    }


@dataclass(frozen=True)
class ExportedWeights:
    """What a folder export (--open-clip-dir, --transformers-dir) checks and records of the weights."""

    source: WeightSource
    run: dict[str, Any]  # the resolved config the run saved ({} for other sources)
    model: str
    tokenizer: str

    @classmethod
    def check(cls, source: WeightSource, model: str, *, ids: str) -> ExportedWeights:
        """Refuse weights trained with another tokenizer than OpenCLIP's, or of an unknown model.
        `ids`: what the export's tokenizer gives, for the message."""
        run = saved_run_config(source)
        # A bigclip file that does not say which tokenizer it was trained with: the default.
        tokenizer = weights_tokenizer(source) or OPENCLIP_TOKENIZER
        if tokenizer != OPENCLIP_TOKENIZER:
            raise ConfigError(
                f"{source.uri} was trained with --tokenizer {tokenizer}; {ids} this text tower never "
                "learned. Export weights trained with --tokenizer open_clip"
            )
        name = model or source.model or run.get("model", {}).get("model", "")
        if not name:
            raise ConfigError(f"{source.uri} does not say which model it holds: pass --model NAME")
        return cls(source, run, name, tokenizer)

    def record(self) -> dict[str, Any]:
        """The config file's "bigclip" entry: where the weights came from."""
        uri, step = self.source.uri, self.source.step
        return {"source": uri, "step": step, "model": self.model, "tokenizer": self.tokenizer}

    def metadata(self, dtype: str) -> dict[str, str]:
        return {"format": "pt", "bigclip.source": self.source.uri, "bigclip.dtype": dtype,
                "bigclip.model": self.model, "bigclip.tokenizer": self.tokenizer}  # fmt: skip

    def manifest(self, dtype: str, tensors: int) -> dict[str, Any]:
        uri, step = self.source.uri, self.source.step
        return {"source": uri, "model": self.model, "step": step, "dtype": dtype, "tensors": tensors}


def free_folder(folder: str, names: Iterable[str], *, overwrite: bool) -> Location:
    """`folder`, refusing (StorageError) to replace any of `names` there without --overwrite."""
    location = open_location(folder)
    taken = [n for n in names if location.exists(n)]
    if taken and not overwrite:
        raise StorageError(f"{folder}: {', '.join(taken)} exist; pass --overwrite, or choose another folder")
    return location


def export_open_clip(
    source: WeightSource,
    pairs: list[tuple[TensorInfo, TensorInfo]],
    folder: str,
    *,
    model: str = "",
    dtype: str,
    overwrite: bool = False,
    pieces_of: Any,
    on_bytes: Any = lambda n: None,
) -> WriteResult:
    """Write DIR from the consolidation's (source tensor, output tensor) pairs; `pieces_of(pairs)`
    streams their bytes (see consolidate.py)."""
    exported = ExportedWeights.check(
        source, model, ids="OpenCLIP tokenizes with its BPE tokenizer, whose ids"
    )
    model_cfg = model_config(exported.model, exported.run, {o.name: tuple(o.shape) for _, o in pairs})
    files = model_tokenizer_files(model_cfg["text_cfg"], model=exported.model)
    preprocess_cfg = preprocess_config(exported.run)
    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg, "bigclip": exported.record()}
    location = free_folder(folder, [*files, CONFIG_NAME], overwrite=overwrite)
    plan = plan_output(f"{folder.rstrip('/')}/{WEIGHTS_NAME}", [o for _, o in pairs])
    metadata, manifest = exported.metadata(dtype), exported.manifest(dtype, len(pairs))
    result = write_safetensors(
        plan, pieces_of(pairs), metadata=metadata, manifest=manifest, overwrite=overwrite,
        on_bytes=on_bytes,
    )  # fmt: skip
    for file_name, data in files.items():
        location.write_bytes(file_name, data)
    location.write_bytes(CONFIG_NAME, json.dumps(config, indent=2).encode())  # last: the commit
    return result
