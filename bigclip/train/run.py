"""`Run`: what the training loop carries around, by concern: what the run is (config, engine,
loss, data), where it writes (the checkpointer, the metric sinks), what guards it (preemption,
the step watchdog, a registry lease) and how far it is (`Progress`).

Its own module, below the loop, so the modules the loop calls (step_log.py...) can name the type
without importing the loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bigclip.train.checkpoint_contents import TrainState
from bigclip.train.zeroshot import ZeroShot

if TYPE_CHECKING:
    import torch

    from bigclip import data
    from bigclip.config import TrainConfig
    from bigclip.distributed import Runtime
    from bigclip.engines import Engine
    from bigclip.registry.leases import HeldLease  # only with --pretrained registry:NAME
    from bigclip.train.checkpointer import Checkpointer
    from bigclip.train.metrics import Scalars
    from bigclip.train.phases import Phase
    from bigclip.train.preemption import PreemptionWatcher
    from bigclip.train.run_lock import RunLock
    from bigclip.train.watchdog import StepWatchdog

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Guards:
    """What watches the run from outside its steps, released together when it ends."""

    preemption: PreemptionWatcher
    watchdog: StepWatchdog
    lease: HeldLease | None = None  # on rank 0, with --pretrained registry:NAME
    run_lock: RunLock | None = None  # held on rank 0: the run folder is this run's

    def close(self) -> None:
        self.watchdog.close()
        self.preemption.close()
        if self.lease is not None:
            self.lease.release()
        if self.run_lock is not None:
            self.run_lock.release()


@dataclass
class Progress:
    """How far the run is: the saved train state and what the loop derives around it."""

    state: TrainState = field(default_factory=TrainState)
    data_position: dict | None = None  # where the data stream resumes in the current epoch
    total_steps: int = 0  # the horizon: the step the run ends at (schedule.run_horizon)
    steps_per_epoch: int = 0  # planned optimizer steps per epoch (the LR schedule's cooldown uses it)
    last_loss: float | None = None  # the global loss at the latest log step
    last_lr: float = 0.0  # the LR of the latest step (recorded in each checkpoint's manifest)
    step_from_epoch: bool = False  # resumed from OpenCLIP: fit sets the step from the epoch
    saved_schedule: dict = field(default_factory=dict)  # the resumed checkpoint's (schedule.saved_schedule)
    first_step: Phase | None = None  # open from the loop's start until a step completes

    def schedule_record(self) -> dict[str, float]:
        """For the manifest of a checkpoint saved now: the schedule's horizon and the last LR."""
        return {"end_step": self.total_steps, "lr": self.last_lr} if self.total_steps else {}


@dataclass
class Run:
    """What the loop carries around."""

    cfg: TrainConfig
    runtime: Runtime
    run_dir: Path
    engine: Engine
    loss_fn: torch.nn.Module
    tokenizer: Any
    shards: data.ShardList
    checkpointer: Checkpointer
    scalars: Scalars  # --report-to: TensorBoard, wandb
    guards: Guards
    progress: Progress
    zeroshot: ZeroShot = field(default_factory=ZeroShot)  # --imagenet-val / --imagenet-v2

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.cfg.optim.accum_freq * self.runtime.world_size


def between_steps(fn: F) -> F:
    """Decorates a loop function of a Run that runs between steps and may take long (evaluation,
    building a loader): the step watchdog pauses while it runs, and so does the checkpointer's
    minutes-of-training clock."""

    @functools.wraps(fn)
    def wrapper(run: Run, *args: Any, **kwargs: Any) -> Any:
        with run.guards.watchdog.paused(), run.checkpointer.paused():
            return fn(run, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
