"""What a training checkpoint holds, and the training state it carries.

Storage, commit and resharding live in `bigclip.checkpoint.CheckpointStore`; this module
decides the contents:
  model, optim   the engine's Stateful state (resharded by DCP to the current world size)
  train          step, epoch, steps into the epoch, samples seen, the resolved config: one value
                 for the whole run, in DCP
  rank state     each rank's own RNG state and data-loader position, in its rank record (the
                 store's `rank_state`): nothing per rank is gathered at a save, and a resume
                 reads its own, not the whole world's
A run resumed at M ranks gives rank r the RNG of saved rank r when it existed, else a fresh
stream seeded from (seed, rank, step). Checkpoints saved before rank records kept the RNG of
every rank and the data position in DCP (`LEGACY_KEYS`); they still load.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bigclip.checkpoint.mirror import MOST_RECENT_ONLY
from bigclip.config import TrainConfig
from bigclip.distributed import Runtime
from bigclip.engines import Engine
from bigclip.models.run_options import image_size
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
    schedule: Callable[[], dict[str, float]] = field(default=dict)  # the LR schedule, for the resume note

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.cfg.optim.accum_freq * self.runtime.world_size

    def state(self, train_state: TrainState) -> dict[str, Any]:
        """The dict DCP saves and, on resume, loads into: it must hold every key to restore."""
        train = {**asdict(train_state), "config": json.dumps(redact(self.cfg.to_dict()))}
        return {**self.engine.checkpoint_state(), "train": train}

    def rank_state(self, data_position: dict | None) -> dict[str, Any]:
        """This rank's own part (the store keeps it in the rank's record)."""
        return {"rng": _rng_state(self.runtime.device), "data": data_position}

    def load_target(self) -> dict[str, Any]:
        """What a resume loads into, placeholders of older checkpoints' per-rank values included."""
        target = self.state(TrainState())
        target["train"].update({key.split(".", 1)[1]: "" for key in LEGACY_KEYS})
        return target

    def meta(self, *, most_recent_only: bool = False) -> dict[str, Any]:
        """The manifest's trainer metadata (what --resume checks before loading anything)."""
        meta = {
            "engine": self.cfg.engine.engine,
            "model": self.cfg.model.model,
            "global_batch": self.global_batch,
            "tokenizer": self.cfg.data.tokenizer,  # the ids the weights learned (checked on --resume/--pretrained)
            "image_size": image_size(self.cfg),  # --force-image-size's (checked on --resume)
            "loss": self.cfg.loss.loss,  # siglip's model has a logit bias, clip's none (checked on --resume)
        }
        if self.schedule():  # in the manifest, not the DCP state: older checkpoints load unchanged
            meta["schedule"] = self.schedule()
        return {**meta, MOST_RECENT_ONLY: True} if most_recent_only else meta


LEGACY_KEYS = ("train.rng", "train.data")  # in DCP before rank records: every rank's RNG, the position


def loaded_state(
    train: dict[str, Any], own: dict[str, Any] | None, runtime: Runtime, *, seed: int
) -> tuple[TrainState, dict | None]:
    """The train state and data position of a loaded checkpoint (`train`: its "train" entry;
    `own`: this rank's saved rank state, None if it had none); restores this rank's RNG."""
    state = TrainState(**{k: int(train[k]) for k in asdict(TrainState())})
    if train.get("rng"):  # saved before rank records
        saved = json.loads(train["rng"])
        own = {
            "rng": saved[runtime.rank] if runtime.rank < len(saved) else None,
            "data": json.loads(train["data"]),
        }
    _restore_rng((own or {}).get("rng"), runtime, seed=seed, step=state.step)
    return state, (own or {}).get("data")


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


def _restore_rng(mine: dict | None, runtime: Runtime, *, seed: int, step: int) -> None:
    if mine is None:  # no saved rank of this number: a fresh stream of its own
        torch.manual_seed(seed + 100_003 * step + runtime.rank)
        random.seed(seed + 100_003 * step + runtime.rank)
        return
    torch.set_rng_state(_unb64(mine["torch"]))
    if mine["cuda"] is not None and runtime.device.type == "cuda":
        torch.cuda.set_rng_state(_unb64(mine["cuda"]), runtime.device)
    random.setstate((3, tuple(mine["python"]), None))
