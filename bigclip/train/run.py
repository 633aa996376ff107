"""`Run`: what the training loop carries around (config, engine, store, state, helpers).

Its own module, below the loop, so the modules the loop calls (step_log.py...) can name the type
without importing the loop (they once formed an import circle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bigclip.train.checkpointing import TrainState
from bigclip.train.zeroshot import ZeroShot

if TYPE_CHECKING:
    import torch

    from bigclip import data
    from bigclip.checkpoint import CheckpointStore
    from bigclip.config import TrainConfig
    from bigclip.distributed import Runtime
    from bigclip.engines import Engine
    from bigclip.registry.leases import HeldLease  # only with --pretrained registry:NAME
    from bigclip.train.metrics import Scalars
    from bigclip.train.preemption import PreemptionWatcher
    from bigclip.train.remote_sync import RemoteSync
    from bigclip.train.watchdog import StepWatchdog


@dataclass
class Run:
    """What the loop carries around."""

    cfg: TrainConfig
    runtime: Runtime
    run_dir: Path
    engine: Engine
    loss_fn: torch.nn.Module
    tokenizer: Any
    scalars: Scalars  # --report-to: TensorBoard, wandb
    shards: data.ShardList
    store: CheckpointStore
    state: TrainState = field(default_factory=TrainState)
    data_position: dict | None = None  # where the data stream resumes in the current epoch
    total_steps: int = 0
    steps_per_epoch: int = 0  # planned optimizer steps per epoch (the LR schedule's cooldown uses it)
    last_loss: float | None = None  # the global loss at the latest log step
    last_saved_step: int = -1
    step_from_epoch: bool = False  # resumed from OpenCLIP: fit sets the step from the epoch
    preemption: PreemptionWatcher | None = None
    remote_sync: RemoteSync | None = None
    watchdog: StepWatchdog | None = None
    pretrained_lease: HeldLease | None = None  # on rank 0, with --pretrained registry:NAME
    zeroshot: ZeroShot = field(default_factory=ZeroShot)  # --imagenet-val / --imagenet-v2

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.cfg.optim.accum_freq * self.runtime.world_size
