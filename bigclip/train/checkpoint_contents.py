"""What a training checkpoint holds, and the training state it carries.

Storage, commit and resharding live in `bigclip.checkpoint.CheckpointStore`; this module
decides the contents:
  model, optim   the engine's Stateful state (resharded by DCP to the current world size)
  train          step, epoch, steps into the epoch, samples seen, the data-loader position
                 (world-size independent), every rank's RNG state, the resolved config
Per-rank values are gathered into one replicated list, since DCP keeps one copy of a key that
several ranks hold. A run resumed at M ranks gives rank r the RNG of saved rank r when it
existed, else a fresh stream seeded from (seed, rank, step).
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from bigclip.checkpoint.mirror import MOST_RECENT_ONLY
from bigclip.config import TrainConfig
from bigclip.distributed import Runtime
from bigclip.engines import Engine
from bigclip.storage.redact import redact


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch in progress (or next, when saved at an epoch end)
    epoch_step: int = 0  # optimizer steps into that epoch
    samples_seen: int = 0


@dataclass
class CheckpointContents:
    """Builds a checkpoint of this run at save time (the Checkpointer asks, the store writes)."""

    engine: Engine
    cfg: TrainConfig
    runtime: Runtime

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.cfg.optim.accum_freq * self.runtime.world_size

    def state(self, train_state: TrainState, data_position: dict | None) -> dict[str, Any]:
        """Collective (the RNG states are gathered). The dict DCP saves and, on resume, loads
        into: it must hold every key to restore."""
        train = {
            **asdict(train_state),
            "data": json.dumps(data_position),
            "rng": json.dumps(_gather(_rng_state(self.runtime.device), self.runtime.world_size)),
            "config": json.dumps(redact(self.cfg.to_dict())),
        }
        return {**self.engine.checkpoint_state(), "train": train}

    def meta(self, *, most_recent_only: bool = False) -> dict[str, Any]:
        """The manifest's trainer metadata (what --resume checks before loading anything)."""
        meta = {
            "engine": self.cfg.engine.engine,
            "model": self.cfg.model.model,
            "global_batch": self.global_batch,
            "tokenizer": self.cfg.data.tokenizer,  # the ids the weights learned (checked on --resume/--pretrained)
            "image_size": self.engine.unwrapped().image_size,  # --force-image-size's (checked on --resume)
        }
        return {**meta, MOST_RECENT_ONLY: True} if most_recent_only else meta


def loaded_state(train: dict[str, Any], runtime: Runtime, *, seed: int) -> tuple[TrainState, dict | None]:
    """The train state and data position a loaded checkpoint's "train" entry holds; restores this
    rank's RNG from it."""
    state = TrainState(**{k: int(train[k]) for k in asdict(TrainState())})
    _restore_rng(json.loads(train["rng"]), runtime, seed=seed, step=state.step)
    return state, json.loads(train["data"])


def _gather(value: Any, world: int) -> list[Any]:
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _rng_state(device: torch.device) -> dict[str, Any]:
    """JSON-able, so the gathered list is one opaque value whatever the world size."""
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": _b64(torch.cuda.get_rng_state(device)) if device.type == "cuda" else None,
        "python": list(random.getstate()[1]),
    }


def _restore_rng(saved: list[dict], runtime: Runtime, *, seed: int, step: int) -> None:
    if runtime.rank >= len(saved):
        torch.manual_seed(seed + 100_003 * step + runtime.rank)
        random.seed(seed + 100_003 * step + runtime.rank)
        return
    mine = saved[runtime.rank]
    torch.set_rng_state(_unb64(mine["torch"]))
    if mine["cuda"] is not None and runtime.device.type == "cuda":
        torch.cuda.set_rng_state(_unb64(mine["cuda"]), runtime.device)
    random.setstate((3, tuple(mine["python"]), None))
