"""The model a run's configuration describes, built by its family (families.py) with the
model-level options applied, and a synthetic batch of the shapes it takes.

Kept apart from the model code: it reads `TrainConfig` and swaps in int8/fp8 linears from `ops`,
while the families' modules (`clip.py` and friends) stay plain modules that know neither.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from bigclip.config import TrainConfig
from bigclip.config.linear_kinds import linear_kind
from bigclip.config.linear_speedups import Decision, device_family, linear_filter
from bigclip.models.contract import LinearSlot, TrainableModel
from bigclip.models.families import family_of, model_shape
from bigclip.models.run_options import model_options
from bigclip.named_objects import import_named


def build_model(cfg: TrainConfig, *, device: str | torch.device = "meta") -> nn.Module:
    """The model --model names, built by its family with the run's model options, then its linears
    swapped for --linear-kind's (before any engine sees it).

    On the meta device by default; an engine that must construct parameters itself (DeepSpeed
    ZeRO-3 under `deepspeed.zero.Init`) calls this again with a real device."""
    build = import_named(family_of(cfg.model.model).build)
    model = build(cfg.model, model_options(cfg), device=device, seed=cfg.optim.seed)
    apply_linear_kind(model, cfg)
    return model


def model_factory(cfg: TrainConfig) -> Callable[[torch.device], nn.Module]:
    """`build_model` for an engine that makes the model again on a real device (ZeRO-3's `rebuild`)."""
    return lambda device: build_model(cfg, device=device)


def run_device_type(cfg: TrainConfig) -> str:
    """Where this run's ranks compute, "cuda" or "cpu" (`--device`, else CUDA when present)."""
    if cfg.engine.device:
        return torch.device(cfg.engine.device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_linear_kind(model: TrainableModel, cfg: TrainConfig) -> None:
    """Swap the blocks' linears for the run's --linear-kind through the module that implements it
    (config/linear_kinds.py): those of its role that --linear-filter keeps (the shapes measured
    faster on this GPU family, config/linear_speedups.py), and say once per process which kind
    runs, on which code path, and which linears it converted and why (`--use-bnb-linear` and
    `--int8` name a kind through OpenCLIP's or bitsandbytes' words: the line says what they became)."""
    kind = linear_kind(cfg.model.linear_kind)
    if not kind.implementation:
        return
    implementation = importlib.import_module(kind.implementation)
    include = kind.includes_attention(cfg.model.int8_attention)
    eligible = [s for s in model.swappable_linears() if s.role == "mlp" or include]
    places = linear_places(model, cfg)
    family = filter_family(cfg)
    decisions = {s.name: linear_filter(kind.name, family, s.in_features, s.out_features, places[s.name][1])
                 for s in eligible}  # fmt: skip
    chosen = [s for s in eligible if decisions[s.name].convert]
    line = implementation.apply(model, kind, slots=chosen, device_type=run_device_type(cfg))
    where = "MLP and attention linears" if include else "MLP linears (attention stays 16-bit)"
    _say_once(f"{line}; {conversion_summary(eligible, decisions, places, where=where)}")


def filter_family(cfg: TrainConfig) -> str:
    """The family whose measured shapes --linear-filter reads: the run's GPU's under auto
    ("cpu" on a CPU), "all", or the family named."""
    if cfg.model.linear_filter != "auto":
        return cfg.model.linear_filter
    device = run_device_type(cfg)
    gpu = device == "cuda" and torch.cuda.is_available()
    return device_family(device, torch.cuda.get_device_capability() if gpu else None)


def linear_places(model: TrainableModel, cfg: TrainConfig) -> dict[str, tuple[str, int]]:
    """Each swappable linear's label ("vision mlp.c_fc": its tower and its name in the block) and
    the rows it multiplies per micro-batch: the per-GPU batch times its tower's tokens per sample,
    from the family's static shape (patch dropout applied), whose towers hold the blocks in order."""
    towers = model_shape(cfg.model.model, model_options(cfg)).towers
    per_block = [(name, t.tokens) for name, t in towers.items() for _ in range(t.layers)]
    names = {id(m): name for name, m in model.named_modules()}
    block_of = {id(m): (i, names[id(b)]) for i, b in enumerate(model.blocks()) for m in b.modules()}
    places = {}
    for slot in model.swappable_linears():
        index, block = block_of[id(slot.parent)]
        tower, tokens = per_block[index]
        places[slot.name] = (f"{tower} {slot.name.removeprefix(block + '.')}", cfg.data.batch_size * tokens)
    return places


def conversion_summary(
    eligible: list[LinearSlot],
    decisions: dict[str, Decision],
    places: dict[str, tuple[str, int]],
    *,
    where: str,
) -> str:
    """E.g. "all 16 MLP linears (attention stays 16-bit) converted (every linear: ...)", or
    "2 of 8 MLP linears ... converted: vision mlp.c_fc x2 64->256 at 4160 tokens (64->256 at 4096
    tokens measured 1.20x); 6 stay 16-bit: vision mlp.c_proj x2 ... (no shape ...)"."""
    converted = sum(d.convert for d in decisions.values())
    reasons = {d.reason for d in decisions.values()}
    if converted == len(eligible) and len(reasons) == 1:
        return f"all {converted} {where} converted ({reasons.pop()})"
    groups: dict[
        tuple[bool, str], dict[tuple[str, str], int]
    ] = {}  # (converted, reason) -> {(label, shape): n}
    for slot in eligible:
        d, (label, tokens) = decisions[slot.name], places[slot.name]
        shape = f"{slot.in_features}->{slot.out_features} at {tokens} tokens"
        counts = groups.setdefault((d.convert, d.reason), {})
        counts[label, shape] = counts.get((label, shape), 0) + 1
    summary = f"{converted} of {len(eligible)} {where} converted"
    for convert in (True, False):
        items = [
            f"{'; '.join(f'{label} x{n} {shape}' for (label, shape), n in counts.items())} ({reason})"
            for (c, reason), counts in groups.items()
            if c == convert
        ]
        if items:
            lead = ": " if convert else f"; {len(eligible) - converted} stay 16-bit: "
            summary += lead + "; ".join(items)
    if not converted:
        summary += "; the kind changes nothing here: --linear-kind none is the same step"
    return summary


_said: set[str] = set()


def _say_once(line: str) -> None:
    """Under the run's logger (rank 0 prints it); ZeRO-3 builds the model twice, the line is one."""
    if line not in _said:
        _said.add(line)
        logging.getLogger("bigclip.models").info(line)


def synthetic_batch(
    cfg: TrainConfig, *, device: str | torch.device = "cpu", batch_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and token ids shaped as the run's model takes them (benchmarks, dry runs), from
    its family's shape and tokenizer. Each text ends where the text tower pools: at the highest id
    (OpenCLIP's end-of-text), or at the tokenizer's `eos_id` for a tower pooled there."""
    name, options = cfg.model.model, model_options(cfg)
    text = family_of(name).tokenizer(name, options)
    size, vocab = model_shape(name, options).image_size, text["vocab_size"]
    b = batch_size or cfg.data.batch_size
    images = torch.randn(b, 3, size, size, device=device)
    texts = torch.randint(1, vocab - 1, (b, text["context_length"]), device=device)
    pool = text.get("text_pool", "argmax")  # build_tokenizer's default
    texts[:, -1] = text["eos_id"] if pool == "eos" else vocab - 1
    return images, texts
