"""When a checkpoint is due: one decision for every boundary the loop reaches.

  STEP       after an optimizer step inside an epoch: --save-every-n-steps, --save-every-n-minutes
             of training, or a stop request (preemption, a time limit)
  EPOCH_END  --save-frequency epochs; --save-most-recent saves the others too, marked not kept
  END        the run's last step, when any cadence is set (or --save-most-recent, not kept)

What a failed save means (`OnFailure`): a periodic one (steps, epochs, minutes) is one warning
line and training goes on: the previous checkpoint stays the latest and the next one tries again.
A stop request's or the end's is the run's last chance to keep its work, so it ends the run with
the requeue code; the requeued job resumes from the latest committed checkpoint.

Minutes of training, and how the ranks agree on them. A save is collective: if one rank saved
and another did not, both would hang. Step and epoch cadences are the same on every rank by
construction; a clock is not (ranks start seconds apart, clocks drift, a slow rank's steps end
later). Preemption has the same problem (a signal reaches ranks at different moments), so the
ranks already all-reduce a flag over the CPU group at every step boundary. The minutes decision
rides on that same tensor: rank 0 alone reads its clock and votes "due", the other ranks vote 0,
and MAX hands every rank rank 0's vote. The cadence thus costs no collective of its own, is
exact to the step, and no other rank's clock is ever read, so ranks cannot disagree. (Rejected:
a broadcast every K steps, which is coarser and one more collective; a step schedule from the
measured step time, which goes wrong as soon as the step time changes.)

What counts as training: the clock restarts when a save returns (time blocked by the save does
not count) and stops while the loop evaluates or builds a data loader (the `between_steps` work
the step watchdog also pauses for). So N minutes of training is N minutes of steps, waits for
data included: about the work a preemption can lose.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bigclip.config import CheckpointConfig
from bigclip.distributed import cpu_group
from bigclip.train.checkpoint_contents import TrainState


class Boundary(enum.Enum):
    STEP = "step"
    EPOCH_END = "epoch end"
    END = "end"


class OnFailure(enum.Enum):
    CONTINUE = "continue"  # periodic: one warning line, training goes on
    REQUEUE = "requeue"  # a stop request or the end: the run ends with the requeue code
    RAISE = "raise"  # a save the caller asked for: its StorageError, to the caller


@dataclass(frozen=True)
class Due:
    reason: str  # logged with the save
    kept: bool = True  # False: --save-most-recent only, deleted when a newer checkpoint commits
    on_failure: OnFailure = OnFailure.CONTINUE


def save_due(
    c: CheckpointConfig, state: TrainState, at: Boundary, *, minutes_due: bool = False, stop_signal: int = 0
) -> Due | None:
    """Whether to checkpoint at `at`, and why (None: not due). `minutes_due` and `stop_signal`
    are the ranks' agreed votes (`agree`), read at STEP boundaries only."""
    if at is Boundary.STEP:
        if stop_signal:
            return Due(f"stop requested by {signal.Signals(stop_signal).name}", on_failure=OnFailure.REQUEUE)
        if c.save_every_n_steps > 0 and state.step % c.save_every_n_steps == 0:
            return Due(f"every {c.save_every_n_steps} steps")
        return Due(f"{c.save_every_n_minutes:g} minutes of training") if minutes_due else None
    if at is Boundary.EPOCH_END:
        if c.save_frequency > 0 and state.epoch % c.save_frequency == 0:
            return Due(f"every {c.save_frequency} epoch(s)")
        return Due("--save-most-recent", kept=False) if c.save_most_recent else None
    final = OnFailure.REQUEUE  # the end: the run's last checkpoint
    if c.save_frequency > 0 or c.save_every_n_steps > 0 or c.save_every_n_minutes > 0:
        return Due("end of training", on_failure=final)
    return Due("--save-most-recent", kept=False, on_failure=final) if c.save_most_recent else None


def agree(*, stop_signal: int, rank0_due: bool) -> tuple[int, bool]:
    """Collective, one all-reduce of two integers over the CPU group: the signal any rank caught,
    and rank 0's minutes vote (pass False on the other ranks)."""
    votes = torch.tensor([stop_signal, int(rank0_due)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=cpu_group())
    return int(votes[0]), bool(votes[1])


class TrainingClock:
    """Seconds of training since the last `restart`, not counting time `paused` (nestable)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._counted = 0.0
        self._since = clock()
        self._pauses = 0

    def seconds(self) -> float:
        running = self._clock() - self._since if self._pauses == 0 else 0.0
        return self._counted + running

    def restart(self) -> None:
        self._counted, self._since = 0.0, self._clock()

    @contextmanager
    def paused(self) -> Iterator[None]:
        if self._pauses == 0:
            self._counted += self._clock() - self._since
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            if self._pauses == 0:
                self._since = self._clock()
