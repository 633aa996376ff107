"""`--pretrained`: start training from OpenCLIP's (or bigclip's) weights, sharded as they arrive.

Accepted: an OpenCLIP tag of the model (`laion2b_s34b_b79k`; an `hf-hub:ORG/REPO` model's own
weights when none is given: see named.py), a `.safetensors` file or index, a `.pt`/`.bin`/`.pth`
state dict or OpenCLIP training checkpoint (`{"state_dict": ...}`, `module.`/`_orig_mod.`
prefixes removed), a bigclip checkpoint (its `model.*` tensors), local, `s3://`, `https://`,
or `registry:NAME` (which holds a lease on NAME while the run lives; see `registry/leases.py`).

Only rank 0 opens the weights. It matches their names and shapes against the model first and
every rank raises the same error, listing missing, unexpected and mis-shaped keys, before any
value is read. Then it reads one tensor at a time (two in flight) and `Engine.load_full_weights`
broadcasts each, every rank keeping its own shard: no rank materialises the whole model. A
missing `logit_bias` (CLIP weights into a SigLIP run) keeps its configured initial value.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from bigclip.checkpoint import LATEST, CheckpointStore
from bigclip.config import TrainConfig
from bigclip.config.checkpoint import REGISTRY_SCHEME, registry_uri
from bigclip.data.tokenizer import check_tokenizer
from bigclip.distributed import Runtime
from bigclip.engines import Engine
from bigclip.errors import BigclipError, ConfigError, StorageError
from bigclip.models.families import family_of
from bigclip.weights.sources import WeightSource, open_weights, weights_tokenizer

log = logging.getLogger("bigclip.pretrained")  # under the run's logger: printed on rank 0

if TYPE_CHECKING:
    from bigclip.registry.leases import HeldLease

KEPT_WHEN_ABSENT = ("logit_bias",)
NOT_WEIGHTS = ("optim.", "train.")  # a consolidated file written --with-optimizer
Opened = TypeVar("Opened")
Shared = TypeVar("Shared")


@dataclass
class WeightPlan:
    names: list[str]  # model parameter names to load, in load order
    source_names: list[str]  # the matching names in the source
    kept: list[str]  # parameters left at their initial values


def match_weights(source: WeightSource, shapes: dict[str, tuple[int, ...]], *, model: str) -> WeightPlan:
    """Pair the source's tensors with the model's parameters, or raise listing every difference."""
    available = {
        info.name[len(source.prefix) :]: info
        for info in source.reader.tensors(source.prefix)
        if not info.name.startswith(NOT_WEIGHTS)
    }
    kept = [n for n in KEPT_WHEN_ABSENT if n in shapes and n not in available]
    missing = sorted(set(shapes) - set(available) - set(kept))
    unexpected = sorted(set(available) - set(shapes))
    mismatched = [
        f"{n}: weights {tuple(available[n].shape)} vs model {tuple(shapes[n])}"
        for n in sorted(set(shapes) & set(available))
        if tuple(available[n].shape) != tuple(shapes[n])
    ]
    if missing or unexpected or mismatched:
        said = f" (the weights say model {source.model})" if source.model and source.model != model else ""
        lines = [f"--pretrained {source.uri} does not fit --model {model}{said}:"]
        lines += _listing("missing from the weights", missing, 20)
        lines += _listing("unexpected in the weights", unexpected, 20)
        lines += _listing("shape mismatches", mismatched, 20)
        raise ConfigError("\n".join(lines))
    names = [n for n in available if n in shapes]  # the source's order: a checked file streams in order
    return WeightPlan(names, [source.prefix + n for n in names], kept)


def _listing(title: str, items: list[str], limit: int) -> list[str]:
    if not items:
        return []
    more = [f"    ... and {len(items) - limit} more"] if len(items) > limit else []
    return [f"  {title} ({len(items)}):", *(f"    {item}" for item in items[:limit]), *more]


def named_weights(cfg: TrainConfig) -> ModuleType | None:
    """The run's model family's module for weights it names rather than gives (CLIP's: OpenCLIP's
    tags and hf-hub: repositories, named.py); None where --pretrained takes paths and URIs only."""
    module = family_of(cfg.model.model).named_weights
    return importlib.import_module(module) if module else None


def apply_preprocess(cfg: TrainConfig, log: logging.Logger) -> None:
    """The named weights' image mean/std unless --image-mean/--image-std are given (every rank:
    it changes the run's config)."""
    named = named_weights(cfg)
    if named is not None:
        named.apply_preprocess(cfg, log)


def applies(cfg: TrainConfig, store: CheckpointStore) -> bool:
    """--pretrained initialises a run that does not resume; a resumed run's checkpoint wins, so
    a requeued job does not read (or lease) the initial weights again."""
    if not cfg.model.pretrained and not family_of(cfg.model.model).has_own_weights(cfg.model.model):
        return False  # (CLIP's hf-hub:ORG/REPO models start from the repository's weights)
    resume = cfg.checkpoint.resume
    return not resume or (resume == LATEST and store.latest() is None)


def _open_on_rank0(
    cfg: TrainConfig, shapes: dict
) -> tuple[tuple[WeightSource, HeldLease | None], WeightPlan]:
    uri, lease = cfg.model.pretrained, None
    module = named_weights(cfg)  # CLIP's: a tag's or an hf-hub model's file, from the Hugging Face cache
    named = module.weights_of(cfg.model) if module is not None else None
    if uri.startswith(REGISTRY_SCHEME):
        from bigclip.registry.registry import Registry, parse_registry_ref  # an offline tool: only now

        owner = f"{cfg.log.name or 'run'}@{os.uname().nodename}"
        registry = Registry(registry_uri(cfg.checkpoint.registry))
        lease = registry.acquire_lease(parse_registry_ref(uri), owner=owner)
        atexit.register(lease.release)  # also on an exception that ends the run; idempotent
    try:
        source = open_weights(named[0] if named else uri, registry=cfg.checkpoint.registry,
                              cache=cfg.model.cache_dir)  # fmt: skip
        if named:
            uri = source.uri = f"{named[1]}: {named[0]}"
        if source.model and source.model != cfg.model.model:
            log.warning(
                f"--pretrained {uri} was saved from model {source.model}; this run builds {cfg.model.model}"
            )
        check_tokenizer(weights_tokenizer(source), cfg.data.tokenizer,
                        allow=cfg.checkpoint.allow_tokenizer_change, what=f"--pretrained {uri}")  # fmt: skip
        return (source, lease), match_weights(source, shapes, model=cfg.model.model)
    except BaseException:
        if lease is not None:
            lease.release()
        raise


def rank0_opens(runtime: Runtime, open_: Callable[[], tuple[Opened, Shared]]) -> tuple[Opened | None, Shared]:
    """Collective: rank 0 runs `open_`, keeping its first value (the other ranks get None) and
    broadcasting its second; a BigclipError there is raised on every rank (a StorageError as
    itself, any other as a ConfigError)."""
    outcome: list[Any] = [None]
    opened = None
    if runtime.rank == 0:
        try:
            opened, shared = open_()
            outcome = [(shared, None)]
        except BigclipError as e:
            outcome = [(None, (type(e).__name__, str(e)))]
    if runtime.world_size > 1:
        dist.broadcast_object_list(outcome, src=0)
    shared, error = outcome[0]
    if error:
        raise (StorageError if error[0] == "StorageError" else ConfigError)(error[1])
    return opened, shared


def load_pretrained(engine: Engine, cfg: TrainConfig, runtime: Runtime) -> HeldLease | None:
    """Collective. Replace the engine's initial weights with `--pretrained`; returns rank 0's lease
    (for registry:NAME), which the caller releases when the run ends."""
    opened, plan = rank0_opens(runtime, lambda: _open_on_rank0(cfg, engine.full_param_shapes()))
    source, lease = opened if opened is not None else (None, None)
    values = None
    if source is not None:  # rank 0
        values = (tensor for _, tensor in source.reader.read_each(plan.source_names, window=2))
    engine.load_full_weights(values, plan.names)
    if source is None:
        return None
    extra = f"; kept initial {', '.join(plan.kept)}" if plan.kept else ""
    step = f" (step {source.step})" if source.step is not None else ""
    log.info(f"loaded {len(plan.names)} tensors from --pretrained {source.uri}{step}{extra}")
    return lease
