"""`bigclip consolidate SRC OUT`: a sharded checkpoint streamed into safetensors, tensor by tensor.

    bigclip consolidate s3://bucket/run/checkpoints model.safetensors            # newest commit
    bigclip consolidate runs/x/checkpoints/step_00001200 s3://b/x/ --max-shard-size 5GB --dtype bf16
    bigclip consolidate registry:vit-h-14-v1 full.safetensors --with-optimizer --registry s3://b/reg
    bigclip consolidate runs/x/checkpoints --open-clip-dir hub/vit-b-32     # OpenCLIP / HF Hub folder
    bigclip consolidate runs/x/checkpoints --transformers-dir hf/vit-b-32   # transformers' CLIPModel

SRC: a bigclip checkpoint written by either engine at any world size (local, `s3://`, or
`registry:NAME`), or a `.safetensors`/`.pt`/`.bin` file to convert. OUT: a `.safetensors`
file, or a folder (local or `s3://`) that receives `model.safetensors`; with `--max-shard-size`,
shards and a Hugging Face index. Keys are OpenCLIP's (the checkpoint's `model.` prefix
dropped), so the file loads into open_clip's CLIP with `strict=True`; the metadata names the
model, step and tokenizer (`bigclip.tokenizer`, which `--pretrained` checks). `--with-optimizer` adds
the Adam moments and steps (fp32, under their checkpoint keys `optim.optimizer.state.*`) and
puts the non-tensor state (param groups, train position, config) as JSON in the metadata.

Memory: the source is read in pieces of `--piece-size` with `--read-ahead` pieces in flight
(64 MiB by default), converted and written as they arrive; a tensor is held whole only when
its shards are not row-major ranges of it (e.g. sharded along dim 1), and then one tensor plus
one shard. Nothing appears under OUT's names until every byte is written; the checksum
manifest (OUT_STEM.manifest.json) is written last. `--open-clip-dir DIR` writes the folder
OpenCLIP's `local-dir:` loader and the Hugging Face Hub take instead (see open_clip_export.py);
`--transformers-dir DIR` the folder `transformers.CLIPModel.from_pretrained` loads
(transformers_export.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from bigclip.errors import ConfigError, StorageError
from bigclip.storage.progress import human_bytes, parse_size, progress_bar
from bigclip.weights.dcp_reader import PIECE_BYTES, TensorInfo
from bigclip.weights.safetensors_writer import WriteResult, plan_output, write_safetensors
from bigclip.weights.sources import WeightSource, open_weights, weights_tokenizer

log = logging.getLogger("bigclip.consolidate")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def output_tensors(
    source: WeightSource, *, dtype: torch.dtype, with_optimizer: bool
) -> list[tuple[TensorInfo, TensorInfo]]:
    """(source tensor, output tensor) pairs: model weights under OpenCLIP names in `dtype`,
    then (with_optimizer) every other tensor under its own key, unconverted."""
    pairs = []
    for info in source.reader.tensors():
        is_weight = info.name.startswith(source.prefix) and not info.name.startswith(("optim.", "train."))
        if is_weight:
            out_dtype = dtype if info.dtype.is_floating_point else info.dtype
            pairs.append((info, TensorInfo(info.name[len(source.prefix) :], out_dtype, info.shape)))
        elif with_optimizer:
            pairs.append((info, info))
    if not pairs:
        raise StorageError(
            f"{source.uri} holds no model weights (no tensors under {source.prefix or 'the root'!r})"
        )
    return pairs


def non_tensor_state(source: WeightSource) -> dict[str, Any]:
    """Param groups, train position, config: plain values, keyed as in the checkpoint."""
    reader = source.reader
    if not hasattr(reader, "value_keys"):
        return {}
    return {key: reader.read_value(key) for key in reader.value_keys() if not key.startswith(source.prefix)}


def _export_transformers(
    source: WeightSource, pairs: list, folder: str, *, model: str, dtype: str, overwrite: bool,
    max_shard_size: str, progress: bool, piece_bytes: int, read_ahead: int,
) -> WriteResult:  # fmt: skip
    from bigclip.weights.transformers_export import prepare

    export = prepare(source, pairs, folder, model=model, dtype=dtype, overwrite=overwrite,
                     max_shard_bytes=parse_size(max_shard_size) if max_shard_size else 0)  # fmt: skip
    bar = progress_bar(sum(o.nbytes for _, o in pairs), label="export", enabled=progress)
    pieces = source.reader.stream([s for s, _ in pairs], piece_bytes=piece_bytes, window=read_ahead)
    result = export.write(pieces, on_bytes=bar.update)
    bar.close()
    log.info("exported %s -> %s for transformers' CLIPModel", source.uri, folder)
    return result


def consolidate(
    src: str,
    out: str,
    *,
    dtype: str = "fp32",
    max_shard_size: str = "",
    with_optimizer: bool = False,
    overwrite: bool = False,
    registry: str = "",
    progress: bool = False,
    piece_bytes: int = PIECE_BYTES,
    read_ahead: int = 4,
    open_clip_dir: str = "",
    transformers_dir: str = "",
    model: str = "",
) -> WriteResult:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    source = open_weights(src, registry=registry)
    pairs = output_tensors(source, dtype=DTYPES[dtype], with_optimizer=with_optimizer)
    if transformers_dir:
        return _export_transformers(source, pairs, transformers_dir, model=model, dtype=dtype, overwrite=overwrite,
                                    max_shard_size=max_shard_size, progress=progress, piece_bytes=piece_bytes,
                                    read_ahead=read_ahead)  # fmt: skip
    if open_clip_dir:
        from bigclip.weights.open_clip_export import export_open_clip

        def pieces_of(chosen: list) -> Any:
            return source.reader.stream([s for s, _ in chosen], piece_bytes=piece_bytes, window=read_ahead)

        bar = progress_bar(sum(o.nbytes for _, o in pairs), label="export", enabled=progress)
        result = export_open_clip(source, pairs, open_clip_dir, model=model, dtype=dtype, overwrite=overwrite,
                                  pieces_of=pieces_of, on_bytes=bar.update)  # fmt: skip
        bar.close()
        return result
    plan = plan_output(
        out, [o for _, o in pairs], max_shard_bytes=parse_size(max_shard_size) if max_shard_size else 0
    )
    metadata = {"format": "pt", "bigclip.source": source.uri, "bigclip.dtype": dtype}
    metadata |= {"bigclip.model": source.model} if source.model else {}
    metadata |= {"bigclip.step": str(source.step)} if source.step is not None else {}
    tokenizer = weights_tokenizer(source)  # the ids the text tower learned: --pretrained checks it
    metadata |= {"bigclip.tokenizer": tokenizer} if tokenizer else {}
    if with_optimizer:
        metadata["bigclip.state"] = json.dumps(non_tensor_state(source), default=str)
    total = sum(o.nbytes for _, o in pairs)
    bar = progress_bar(total, label="consolidate", enabled=progress)
    pieces = source.reader.stream([s for s, _ in pairs], piece_bytes=piece_bytes, window=read_ahead)
    manifest = {"source": source.uri, "model": source.model, "step": source.step, "dtype": dtype,
                "tokenizer": tokenizer, "with_optimizer": with_optimizer, "tensors": len(pairs)}  # fmt: skip
    result = write_safetensors(
        plan, pieces, metadata=metadata, manifest=manifest, overwrite=overwrite, on_bytes=bar.update
    )
    bar.close()
    log.info(
        "consolidated %s -> %s (%d files, %s)", source.uri, plan.folder, len(plan.files), human_bytes(total)
    )
    return result
