"""`--resume epoch_32.pt`: continue an OpenCLIP training run in bigclip, at any world size,
under either engine.

OpenCLIP's trainer saves `{"epoch", "name", "state_dict", "optimizer", "scaler"}` with
`torch.save` at epoch ends (`state_dict` keys with `module.` when saved from DDP, and
`optimizer` the `state_dict()` of torch's AdamW over two groups). What carries over:
  weights     by parameter name, checked against the model like --pretrained;
  moments     AdamW's exp_avg / exp_avg_sq and step count: its state is keyed by position
              (0, 1, ...) in its groups, which OpenCLIP fills in `named_parameters()` order, gains
              and biases (no weight decay) first, then the rest, trainable parameters only; the
              same rule applied to this run's model gives each position its name, and every
              moment's shape is checked against its parameter;
  epoch       OpenCLIP's completed epochs: training continues with the next one, from the step
              OpenCLIP's trainer would take there (epoch x this run's optimizer steps per epoch,
              set by the loop once the loader is built); AdamW's step count is only its bias
              correction, so a run at another global batch starts the right epoch at the right LR.
What does not: the data position (OpenCLIP records none; the epoch starts over in bigclip's
order), the RNG states, the fp16 loss scale (it restarts), the optimizer hyperparameters
(bigclip's flags apply; differences are listed). Rank 0 reads the file (memory-mapped) and every
value is broadcast one tensor at a time, so no rank holds the whole state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from bigclip.config import TrainConfig
from bigclip.data.tokenizer import check_tokenizer
from bigclip.distributed import Runtime
from bigclip.engines import Engine
from bigclip.engines.optimizer import MOMENTS, weight_decay_split
from bigclip.errors import ConfigError, StorageError
from bigclip.weights.dcp_reader import prefetch
from bigclip.weights.pretrained import match_weights, rank0_opens
from bigclip.weights.sources import TORCH_SUFFIXES, WeightSource, open_weights

log = logging.getLogger("bigclip.resume")
OPENCLIP_TOKENIZER = "open_clip"


def is_openclip_checkpoint(uri: str) -> bool:
    return uri.rstrip("/").endswith(TORCH_SUFFIXES)


@dataclass
class OpenClipPlan:
    weights: list[str]  # model parameter names, in load order
    moments: list[str]  # trained parameter names whose AdamW state is loaded
    positions: list[int]  # their keys in OpenCLIP's optimizer state
    epoch: int  # OpenCLIP's completed epochs: the run continues with this one
    adam_step: int  # AdamW's step count (its bias correction), not the run's step
    notes: list[str] = field(default_factory=list)  # what did not carry over


def load_openclip_checkpoint(engine: Engine, cfg: TrainConfig, runtime: Runtime, uri: str) -> OpenClipPlan:
    """Collective: load weights and AdamW state into the engine; returns what was loaded."""
    # OpenCLIP's CLIP models all use its BPE tokenizer: --tokenizer hashing would misread them.
    allow, what = cfg.checkpoint.allow_tokenizer_change, f"--resume {uri}"
    check_tokenizer(OPENCLIP_TOKENIZER, cfg.data.tokenizer, allow=allow, what=what)
    opened, plan = rank0_opens(runtime, lambda: _open(uri, engine, cfg))
    source, checkpoint = opened if opened is not None else (None, None)
    weights = moments = None
    if source is not None:  # rank 0
        weights = (tensor for _, tensor in prefetch(plan.weights, source.reader.read, window=2))
        moments = _moments(checkpoint, plan)
    engine.load_full_weights(weights, plan.weights)
    engine.load_full_moments(moments, plan.moments, step=plan.adam_step)
    return plan


def _open(uri: str, engine: Engine, cfg: TrainConfig) -> tuple[tuple[WeightSource, dict], OpenClipPlan]:
    source = open_weights(uri)  # a local file (remote ones are downloaded once)
    if source.kind != "torch":
        raise StorageError(f"--resume {uri}: not an OpenCLIP checkpoint (a torch .pt file)")
    checkpoint = torch.load(source.reader.path, map_location="cpu", weights_only=True, mmap=True)
    checkpoint = checkpoint if isinstance(checkpoint, dict) else {}
    return (source, checkpoint), plan_resume(source, checkpoint, engine, cfg)


def plan_resume(source: WeightSource, checkpoint: dict, engine: Engine, cfg: TrainConfig) -> OpenClipPlan:
    shapes = engine.full_param_shapes()
    weights = match_weights(source, shapes, model=cfg.model.model)  # raises listing differences
    if "epoch" not in checkpoint or "optimizer" not in checkpoint:
        note = "the file holds weights only (no epoch or optimizer): Adam state starts at zero, epoch 0"
        return OpenClipPlan(weights.names, [], [], 0, 0, [note])
    positions = _positions(list(source.reader.tensors_by_name), engine.trained_names(), shapes)
    optimizer = checkpoint["optimizer"]
    _check_groups(optimizer, positions, uri=source.uri)
    names = [n for group in positions for n in group]
    ids = [i for group in optimizer["param_groups"] for i in group["params"]]
    state = {name: optimizer["state"].get(i, {}) for name, i in zip(names, ids)}
    for name in names:
        _check_entry(name, state[name], shapes[name], uri=source.uri)
    steps = {int(torch.as_tensor(s["step"]).item()) for s in state.values() if "step" in s}
    notes = _not_carried(checkpoint, optimizer, cfg)
    if len(steps) > 1:
        notes.append(
            f"AdamW step counts differed per parameter ({sorted(steps)}); all continue from {max(steps)}"
        )
    stepped = [(n, i) for n, i in zip(names, ids) if state[n]]  # the others keep zero moments
    return OpenClipPlan(
        weights.names, [n for n, _ in stepped], [i for _, i in stepped], int(checkpoint["epoch"]),
        max(steps, default=0), notes,
    )  # fmt: skip


def _positions(saved: list[str], trained: list[str], shapes: dict) -> tuple[list[str], list[str]]:
    """OpenCLIP's two AdamW groups as parameter names: (no weight decay, weight decay)."""
    trainable = set(trained)
    return weight_decay_split(
        (n, shapes[n], n) for n in saved if n in trainable
    )  # in named_parameters() order


def _check_groups(optimizer: dict, positions: tuple[list[str], list[str]], *, uri: str) -> None:
    groups = optimizer.get("param_groups", [])
    saved = [len(g["params"]) for g in groups]
    wanted = [len(p) for p in positions]
    if saved != wanted:
        raise ConfigError(
            f"--resume {uri}: OpenCLIP's AdamW holds {sum(saved)} parameters in groups of {saved} "
            f"(no weight decay, weight decay); this run trains {sum(wanted)} ({wanted}). Resume with the "
            "--lock-image/--lock-text options the OpenCLIP run used, or start from its weights with "
            "--pretrained"
        )


def _check_entry(name: str, entry: dict, shape: tuple[int, ...], *, uri: str) -> None:
    if not entry:
        return
    if not all(k in entry for k in MOMENTS):
        raise ConfigError(
            f"--resume {uri}: the optimizer state of {name} has {sorted(entry)}, not AdamW's "
            "exp_avg/exp_avg_sq; only torch AdamW state resumes (use --pretrained for the weights)"
        )
    for key in MOMENTS:
        if tuple(entry[key].shape) != tuple(shape):
            raise ConfigError(
                f"--resume {uri}: {key} of {name} has shape {tuple(entry[key].shape)}, the parameter "
                f"{tuple(shape)}: the optimizer's parameter order is not OpenCLIP's"
            )


def _not_carried(checkpoint: dict, optimizer: dict, cfg: TrainConfig) -> list[str]:
    notes = [
        "data position: OpenCLIP records none, so the epoch starts over in bigclip's order",
        "random number generator states (bigclip seeds afresh)",
    ]
    if checkpoint.get("scaler") and cfg.engine.precision == "amp":
        notes.append(f"fp16 loss scale {checkpoint['scaler'].get('scale')} (it restarts at 65536)")
    o = cfg.optim
    flags = {"betas": (o.beta1, o.beta2), "eps": o.eps}
    for group, wd in zip(optimizer["param_groups"], (0.0, o.wd)):
        flags["weight_decay"] = wd
        for key, value in flags.items():
            saved = tuple(group[key]) if isinstance(group.get(key), (list, tuple)) else group.get(key)
            if saved is not None and saved != value:
                notes.append(f"optimizer {key} {saved} (this run uses {value}, from its flags)")
    return sorted(set(notes), key=notes.index)


def _moments(checkpoint: dict, plan: OpenClipPlan) -> Iterator[torch.Tensor]:
    """exp_avg then exp_avg_sq of each planned parameter, in order."""
    state = checkpoint["optimizer"]["state"]
    for position in plan.positions:
        for key in MOMENTS:
            yield state[position][key]
