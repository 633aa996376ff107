"""The model a run's configuration describes, with its model-level options applied, and a
synthetic batch of the shapes it takes.

Kept apart from the model code: it reads `TrainConfig` and swaps in int8/fp8 linears from `ops`,
while `clip.py` and friends stay plain modules that know neither.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable

import torch

from bigclip.config import TrainConfig
from bigclip.config.linear_kinds import linear_kind
from bigclip.config.linear_speedups import Decision, device_family, linear_filter
from bigclip.models.clip import CLIP, CLIPConfig
from bigclip.models.clip_family import SIGLIP_INIT, kept_patches
from bigclip.models.contract import LinearSlot
from bigclip.models.factory import create_model, get_model_config
from bigclip.models.families import model_options
from bigclip.models.lock import apply_locks


def forced(cfg: TrainConfig) -> dict[str, int | bool]:
    """OpenCLIP's --force-quick-gelu/--force-image-size/--force-context-length as config overrides."""
    options = model_options(cfg)
    return {
        "force_quick_gelu": options.quick_gelu,
        "force_image_size": options.image_size,
        "force_context_length": options.context_length,
    }


def model_config(cfg: TrainConfig) -> CLIPConfig:
    """The config of the model this run builds (its --model with the --force-* options applied)."""
    return get_model_config(cfg.model.model, cache_dir=cfg.model.cache_dir, **forced(cfg))


def build_model(cfg: TrainConfig, *, device: str | torch.device = "meta") -> CLIP:
    """The model with its model-level options applied (before any engine sees it).

    On the meta device by default; an engine that must construct parameters itself (DeepSpeed
    ZeRO-3 under `deepspeed.zero.Init`) calls this again with a real device."""
    extra = SIGLIP_INIT if cfg.loss.loss == "siglip" else {}
    model = create_model(
        cfg.model.model,
        device=device,
        patch_dropout=cfg.model.force_patch_dropout,
        seed=cfg.optim.seed,
        cache_dir=cfg.model.cache_dir,  # where an hf-hub:ORG/REPO model's config is cached
        **extra,
        **forced(cfg),
    )
    model.set_grad_checkpointing(
        cfg.model.grad_checkpointing,
        every=cfg.model.grad_checkpointing_every,
        policy=cfg.model.grad_checkpointing_policy,
    )
    apply_linear_kind(model, cfg)
    apply_locks(model, cfg.model)
    return model


def model_factory(cfg: TrainConfig) -> Callable[[torch.device], CLIP]:
    """`build_model` for an engine that makes the model again on a real device (ZeRO-3's `rebuild`)."""
    return lambda device: build_model(cfg, device=device)


def run_device_type(cfg: TrainConfig) -> str:
    """Where this run's ranks compute, "cuda" or "cpu" (`--device`, else CUDA when present)."""
    if cfg.engine.device:
        return torch.device(cfg.engine.device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_linear_kind(model: CLIP, cfg: TrainConfig) -> None:
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
    device, family = run_device_type(cfg), filter_family(cfg)
    tokens = {s.name: slot_tokens(model.cfg, s.name, cfg) for s in eligible}
    decisions = {
        s.name: linear_filter(kind.name, family, s.in_features, s.out_features, tokens[s.name])
        for s in eligible
    }
    chosen = [s for s in eligible if decisions[s.name].convert]
    line = implementation.apply(model, kind, slots=chosen, device_type=device)
    where = "MLP and attention linears" if include else "MLP linears (attention stays 16-bit)"
    _say_once(f"{line}; {conversion_summary(eligible, decisions, tokens, where=where)}")


def filter_family(cfg: TrainConfig) -> str:
    """The family whose measured shapes --linear-filter reads: the run's GPU's under auto
    ("cpu" on a CPU), "all", or the family named."""
    if cfg.model.linear_filter != "auto":
        return cfg.model.linear_filter
    device = run_device_type(cfg)
    gpu = device == "cuda" and torch.cuda.is_available()
    return device_family(device, torch.cuda.get_device_capability() if gpu else None)


def slot_tokens(model_cfg: CLIPConfig, name: str, cfg: TrainConfig) -> int:
    """Rows a block linear multiplies per micro-batch: the per-GPU batch times its tower's sequence
    (the patches patch dropout keeps plus the class token; the text's context length)."""
    if name.startswith("visual."):
        v = model_cfg.vision_cfg
        sequence = kept_patches((v.image_size // v.patch_size) ** 2, cfg.model.force_patch_dropout) + 1
    else:
        sequence = model_cfg.text_cfg.context_length
    return cfg.data.batch_size * sequence


def conversion_summary(
    eligible: list[LinearSlot], decisions: dict[str, Decision], tokens: dict[str, int], *, where: str
) -> str:
    """E.g. "all 16 MLP linears (attention stays 16-bit) converted (every linear: ...)", or
    "96 of 160 MLP and attention linears converted: visual mlp.c_fc x48 1664->8192 at 16448 tokens
    (1664->8192 at 16384 tokens measured 1.02x); 64 stay 16-bit: text ... (no shape ...)"."""
    converted = sum(d.convert for d in decisions.values())
    reasons = {d.reason for d in decisions.values()}
    if converted == len(eligible) and len(reasons) == 1:
        return f"all {converted} {where} converted ({reasons.pop()})"
    groups: dict[tuple[bool, str], dict[str, int]] = {}  # (converted, reason) -> {label: linears}
    for slot in eligible:
        d = decisions[slot.name]
        label = f"{_group(slot.name)} {slot.in_features}->{slot.out_features} at {tokens[slot.name]} tokens"
        counts = groups.setdefault((d.convert, d.reason), {})
        counts[label] = counts.get(label, 0) + 1
    text = f"{converted} of {len(eligible)} {where} converted"
    for convert in (True, False):
        items = [
            f"{'; '.join(_counted(label, n) for label, n in counts.items())} ({reason})"
            for (c, reason), counts in groups.items()
            if c == convert
        ]
        if items:
            text += (": " if convert else f"; {len(eligible) - converted} stay 16-bit: ") + "; ".join(items)
    if not converted:
        text += "; the kind changes nothing here: --linear-kind none is the same step"
    return text


def _counted(label: str, count: int) -> str:
    """'visual mlp.c_fc 64->256 at 2 tokens', 4 -> 'visual mlp.c_fc x4 64->256 at 2 tokens'."""
    tower, linear, shape = label.split(" ", 2)
    return f"{tower} {linear} x{count} {shape}"


def _group(name: str) -> str:
    """'visual.transformer.resblocks.7.mlp.c_fc' -> 'visual mlp.c_fc'; text blocks -> 'text ...'."""
    tower = "visual" if name.startswith("visual.") else "text"
    return f"{tower} {_BLOCK_PREFIX.sub('', name)}"


_BLOCK_PREFIX = re.compile(r"^.*resblocks[.]\d+[.]")


_said: set[str] = set()


def _say_once(line: str) -> None:
    """Under the run's logger (rank 0 prints it); ZeRO-3 builds the model twice, the line is one."""
    if line not in _said:
        _said.add(line)
        logging.getLogger("bigclip.models").info(line)


def synthetic_batch(
    cfg: TrainConfig, *, device: str | torch.device = "cpu", batch_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and token ids shaped as the run's model takes them (benchmarks, dry runs).

    Each text ends with the highest id, OpenCLIP's end-of-text token, where the text tower pools
    (or the config's eos_id, for a tower pooled there)."""
    model_cfg = model_config(cfg)
    b = batch_size or cfg.data.batch_size
    size, context = model_cfg.vision_cfg.image_size, model_cfg.text_cfg.context_length
    vocab = model_cfg.text_cfg.vocab_size
    images = torch.randn(b, 3, size, size, device=device)
    texts = torch.randint(1, vocab - 1, (b, context), device=device)
    text_cfg = model_cfg.text_cfg
    texts[:, -1] = text_cfg.eos_id if text_cfg.pool_type == "eos" else vocab - 1
    return images, texts
