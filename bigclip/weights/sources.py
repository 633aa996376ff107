"""Open any weights a user points at as one tensor-by-tensor reader.

    source = open_weights("registry:vit-h-14-v1" | "s3://b/run/checkpoints" | "x.safetensors"
                          | "open_clip_pytorch_model.bin" | "https://.../model.pt", registry=...)
    source.reader.tensors(source.prefix)   # names, dtypes, shapes; no tensor data read yet
    source.reader.read(name) / .stream(infos)

Readers: `DcpReader` (bigclip checkpoints, either engine, any world size), `SafetensorsReader`
(a file or an index's shards; ranged reads from any location) and `TorchFileReader` (`.pt`/
`.bin`/`.pth` through `torch.load(weights_only=True, mmap=True)`: pages are read on first touch,
so a big file is never loaded whole). Remote `.pt`/`.bin` files (S3, ...) and anything at a URL a
web server serves (a location that cannot list or read ranges) are downloaded once into a cache
(`$BIGCLIP_CACHE`, default ~/.cache/bigclip), since torch's zip reader needs a local file.

Every byte with a record is checked as it is read (see docs/checkpoints.md, "Integrity on
load"): a bigclip checkpoint's sizes and `.metadata` SHA-256 up front and its chunks' CRC-32s
as they stream; a registry publication's sizes up front and each file's SHA-256 in the pass that
reads it; a consolidated safetensors file against the manifest `bigclip consolidate` wrote
beside it. A `.pt` with a record is hashed in one sequential read before torch maps it (the
pages torch then touches come from the page cache), or while it downloads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bigclip.checkpoint import catalog, rank_record
from bigclip.checkpoint.integrity import CheckpointDamaged, StreamDigest, read_checked
from bigclip.checkpoint.lookup import inspect
from bigclip.checkpoint.manifest import MANIFEST_NAME
from bigclip.config.checkpoint import REGISTRY_SCHEME, registry_uri
from bigclip.data.tokenizer import saved_tokenizer
from bigclip.errors import StorageError
from bigclip.storage.locations import LocalLocation, Location, open_location, open_parent
from bigclip.storage.ranged_reads import BlobFolder
from bigclip.storage.redact import redact_text
from bigclip.weights.dcp_reader import METADATA_NAME, PIECE_BYTES, DcpReader, TensorInfo, cut_whole
from bigclip.weights.output_manifest import checked_files
from bigclip.weights.safetensors_format import INDEX_SUFFIX, Checked, SafetensorsReader

if TYPE_CHECKING:
    from bigclip.registry.registry import Published, Registry

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
CHECKPOINT_PARTS = (MANIFEST_NAME, METADATA_NAME, ".distcp", rank_record.SUFFIX)  # a DCP checkpoint's files
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP and torch.compile wrappers


@dataclass
class WeightSource:
    reader: Any  # DcpReader | SafetensorsReader | TorchFileReader
    uri: str
    kind: str  # dcp | safetensors | torch
    prefix: str = ""  # where the model's weights are ("model." in a bigclip checkpoint)
    model: str = ""
    step: int | None = None


def open_weights(uri: str, *, registry: str = "", cache: str = "") -> WeightSource:
    """`cache`: where remote .pt/.bin files are downloaded (--cache-dir; default `cache_dir()`)."""
    if uri.startswith(REGISTRY_SCHEME):
        from bigclip.registry.registry import Registry, parse_registry_ref  # an offline tool: only now

        return _from_registry(Registry(registry_uri(registry)), parse_registry_ref(uri))
    parent, leaf = open_parent(uri)
    local = isinstance(parent, LocalLocation)
    if not parent.listable or (leaf.endswith(TORCH_SUFFIXES) and not local):
        return _from_file(download(uri, cache=cache), uri=redact_text(uri))
    if leaf.endswith((".safetensors", INDEX_SUFFIX)):
        return _consolidated_source(parent, leaf, uri)
    if local and (parent.root / leaf).is_file():
        if (parent.root / MANIFEST_NAME).is_file() or leaf.endswith(CHECKPOINT_PARTS):
            raise StorageError(
                f"{uri} is a file inside a bigclip checkpoint, not a weights file: give its folder {parent.root}"
            )
        return _from_file(parent.root / leaf, uri=uri)
    return _from_checkpoint(open_location(uri.rstrip("/")), uri)


def _from_checkpoint(location: Location, uri: str) -> WeightSource:
    for consolidated in ("model" + INDEX_SUFFIX, "model.safetensors"):  # `bigclip consolidate SRC FOLDER`
        if location.exists(consolidated):
            return _consolidated_source(location, consolidated, uri)
    if location.exists(MANIFEST_NAME):
        location, folder = open_parent(location.uri)
    else:
        entry = catalog.latest_committed(location)
        if entry is None:
            raise StorageError(
                f"{uri} is neither a weights file (.safetensors, .pt, .bin) nor a committed bigclip checkpoint "
                f"(no {MANIFEST_NAME}; an interrupted save is never read) nor a folder of them"
            )
        folder = entry.folder
    manifest = inspect(location, folder)
    if isinstance(manifest, str):
        raise CheckpointDamaged(manifest)
    reader = DcpReader(BlobFolder(location, folder), metadata_record=manifest.objects.get(METADATA_NAME),
                       rank_records=rank_records(manifest.objects))  # fmt: skip
    return WeightSource(reader, manifest.uri, "dcp", "model.", manifest.model, manifest.step)


def rank_records(names: Iterable[str], root: str = "") -> list[str]:
    """The saved ranks' records among a checkpoint's files (relative to its folder `root`)."""
    prefix = f"{root}/" if root else ""
    return [n[len(prefix) :] for n in names if n.startswith(prefix) and n.endswith(rank_record.SUFFIX)]


def _consolidated_source(location: Location, name: str, uri: str) -> WeightSource:
    """A safetensors file or index, checked against the consolidation manifest beside it, if any."""
    reader = SafetensorsReader(BlobFolder(location), name, checked=checked_files(location, name))
    return _safetensors_source(reader, uri)


def _from_registry(registry: Registry, name: str) -> WeightSource:
    published = registry.get(name)
    problems = registry.size_problems(published)
    if problems:
        raise CheckpointDamaged(
            f"registry:{name} is damaged: {'; '.join(problems)}; {registry.damage_advice(name)}"
        )
    blobs = registry.blob_folder(published)
    checked = registry.checked_files(published)
    entry = published.entry.rpartition("/")[2]
    common = {"uri": f"registry:{name}", "model": published.model, "step": published.step}
    if published.kind == "dcp":
        reader = DcpReader(blobs, metadata_record=published.objects[published.entry],
                           rank_records=rank_records(published.objects, published.root))  # fmt: skip
        return WeightSource(reader, kind="dcp", prefix="model.", **common)
    if published.kind == "safetensors":
        source = _safetensors_source(SafetensorsReader(blobs, entry, checked=checked), common["uri"])
        source.model, source.step = (
            published.model or source.model,
            published.step if published.step is not None else source.step,
        )
        return source
    if published.kind == "torch":
        reader = _registry_torch_file(registry, published, checked[entry])
        return WeightSource(reader, kind="torch", **common)
    raise StorageError(f"{name} holds {len(published.objects)} files but no weights file bigclip can load "
                       "(a checkpoint, .safetensors, .pt or .bin)")  # fmt: skip


def _registry_torch_file(registry: Registry, published: Published, checked: Checked) -> TorchFileReader:
    key = registry.blob_key(published, published.objects[published.entry].sha256)
    if isinstance(registry.location, LocalLocation):
        return TorchFileReader(Path(registry.location.root) / key, checked=checked)  # mapped in place
    path = download(registry.location.child_uri(key), suffix=".pt", checked=checked)
    return TorchFileReader(path)  # checked as it downloaded


def weights_tokenizer(source: WeightSource) -> str:
    """The tokenizer the weights were trained with: a bigclip checkpoint's saved config, a
    consolidated file's `bigclip.tokenizer` metadata; files from elsewhere are OpenCLIP's, whose
    CLIP models all use its BPE tokenizer ('' when a bigclip file does not say)."""
    if source.kind == "dcp":
        has_config = "train.config" in source.reader.value_keys("train.")
        return saved_tokenizer({}, json.loads(source.reader.read_value("train.config"))) if has_config else ""
    metadata = getattr(source.reader, "metadata", {}) if source.kind == "safetensors" else {}
    if "bigclip.tokenizer" in metadata:
        return saved_tokenizer({"tokenizer": metadata["bigclip.tokenizer"]})
    return "" if "bigclip.source" in metadata else "open_clip"


def _safetensors_source(reader: SafetensorsReader, uri: str) -> WeightSource:
    """bigclip's consolidated files say which model and step they hold in their metadata."""
    step = reader.metadata.get("bigclip.step", "")
    model = reader.metadata.get("bigclip.model", "")
    return WeightSource(reader, uri, "safetensors", model=model, step=int(step) if step.isdigit() else None)


def _from_file(path: Path, *, uri: str) -> WeightSource:
    if path.name.endswith(".safetensors"):
        return _safetensors_source(SafetensorsReader(BlobFolder(LocalLocation(path.parent)), path.name), uri)
    return WeightSource(TorchFileReader(path), uri, "torch")


class TorchFileReader:
    """A `.pt`/`.bin`/`.pth` state dict (or OpenCLIP's {'state_dict': ...} checkpoint), memory-mapped.
    `checked`: the file's record, checked in one sequential read before torch maps the file."""

    def __init__(self, path: Path, *, checked: Checked | None = None) -> None:
        self.path = path
        if checked is not None:
            with open(path, "rb") as stream:
                read_checked(stream, checked.digest())
        try:
            loaded = _torch_load(path)
        except Exception as e:
            raise StorageError(
                f"{path}: not a weights file torch can read safely ({_load_failure(e)}). TorchScript archives "
                "(OpenAI's original CLIP .pt files) are not supported: use OpenCLIP's converted weights"
            ) from e
        self.tensors_by_name = normalise_keys(loaded)

    def tensors(self, prefix: str = "") -> list[TensorInfo]:
        return [
            TensorInfo(n, t.dtype, tuple(t.shape))
            for n, t in self.tensors_by_name.items()
            if n.startswith(prefix)
        ]

    def read(self, name: str) -> torch.Tensor:
        return self.tensors_by_name[name]

    def read_each(self, names: list[str], *, window: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.read(name)

    def stream(
        self, infos: list[TensorInfo], *, piece_bytes: int = PIECE_BYTES, window: int = 0
    ) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
        for info in infos:
            yield from cut_whole(info, self.read(info.name), piece_bytes)


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)  # torch < 1.6 files cannot be mapped


def _load_failure(error: BaseException) -> str:
    """torch.load's reason, without its advice to retry with weights_only=False (which would run
    whatever code the file's pickle names)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    kept = [line for line in lines if "weights_only" not in line and "Re-running" not in line]
    reason = (kept or lines or [""])[-1][:300]
    return (
        f"{type(error).__name__}: {reason}"
        if reason
        else f"{type(error).__name__}: the file is empty or cut short"
    )


def normalise_keys(loaded: Any) -> dict[str, torch.Tensor]:
    """OpenCLIP's checkpoint forms -> {parameter name: tensor}: the `state_dict` entry of a
    training checkpoint, without DataParallel's `module.` or torch.compile's `_orig_mod.` prefixes."""
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
    if not isinstance(state, dict):
        raise StorageError(f"expected a state dict, found {type(state).__name__}")
    out = {}
    for key, value in state.items():
        if not torch.is_tensor(value):
            continue  # e.g. an epoch counter stored beside the weights
        for prefix in WRAPPER_PREFIXES:
            while key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def cache_dir(explicit: str = "") -> Path:
    return (
        Path(explicit or os.environ.get("BIGCLIP_CACHE") or Path.home() / ".cache" / "bigclip") / "downloads"
    )


def download(
    uri: str,
    *,
    suffix: str = "",
    cache: str = "",
    checked: Checked | None = None,
) -> Path:
    """A local copy of a remote file, downloaded once (streamed to a temporary name, then renamed).
    `checked`: its record, checked as it downloads (a cached copy: as it is read again here)."""
    leaf = uri.rstrip("/").rpartition("/")[2].split("?")[0] or "download"
    target = cache_dir(cache) / f"{hashlib.sha256(uri.encode()).hexdigest()[:16]}-{leaf}{suffix}"
    digest = checked.digest() if checked else None
    if target.exists():
        if checked is not None:
            _check_cached(target, checked)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        with _open_remote(uri) as stream, open(tmp, "wb") as out:
            if digest is None:
                shutil.copyfileobj(stream, out, 16 << 20)
            else:
                read_checked(stream, digest, sink=out)  # a damaged download never enters the cache
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _check_cached(path: Path, checked: Checked) -> None:
    """A copy downloaded (and checked) earlier, checked again: local disks rot too."""
    advice = "it was deleted: run again to download it anew"
    digest = StreamDigest(checked.record, where=f"{path} (the cached copy of {checked.where})", advice=advice)
    try:
        with open(path, "rb") as stream:
            read_checked(stream, digest)
    except CheckpointDamaged:
        path.unlink(missing_ok=True)
        raise


def _open_remote(uri: str) -> Any:
    parent, leaf = open_parent(uri)
    try:
        return parent.open_read(leaf)
    except parent.read_errors as e:
        raise StorageError(f"cannot download {redact_text(uri)}: {e}") from e
