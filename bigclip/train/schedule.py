"""The learning-rate schedule, step by step, as OpenCLIP's `open_clip_train.scheduler`, over one
horizon: the step where the run actually ends.

  cosine          linear warmup to --lr, then half a cosine to 0 at the last step
  const           linear warmup, then --lr
  const-cooldown  linear warmup, --lr, then over the last --epochs-cooldown epochs a decay
                  (1 - progress) ** --lr-cooldown-power from --lr to --lr-cooldown-end
  --skip-scheduler  --lr from the first step to the last (OpenCLIP never calls the scheduler)

Steps are optimizer steps (OpenCLIP's `i // accum_freq`); warmup wins over cooldown, as there.
The schedule is a pure function of the step, so a resumed run continues it exactly.

The horizon (`run_horizon`) is the earliest end any stopping rule gives: --epochs (the steps left
in this epoch plus whole epochs after it) and --max-steps. The LR schedule, the ETA and the log
all count to it, so `--epochs 5 --max-steps 200` with 31 steps per epoch decays to 0 at step 155,
where the run ends, not at 200. A fresh run's horizon is OpenCLIP's (`epochs x steps per epoch`).
What the horizon cannot foresee: an epoch that ends early because data was lost (then logged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bigclip.config import OptimConfig


@dataclass(frozen=True)
class Horizon:
    """Where the run ends (`end_step`, the LR schedule's last step) and which rule ends it."""

    end_step: int
    reason: str  # e.g. "--epochs 5 x 31 steps; --max-steps 200 is not reached"


def steps_by_epochs(*, step: int, epoch: int, epoch_step: int, steps_per_epoch: int, epochs: int) -> int:
    """The step at which --epochs ends the run, from where the run stands: what is left of the
    current epoch, then whole epochs (a resumed run at another batch size counts its own steps)."""
    if epoch >= epochs:
        return step
    return step + max(0, steps_per_epoch - epoch_step) + (epochs - epoch - 1) * steps_per_epoch


def run_horizon(
    *, step: int, epoch: int, epoch_step: int, steps_per_epoch: int, epochs: int, max_steps: int
) -> Horizon:
    """The earliest end of the stopping rules that are set (--epochs < 1: none; --max-steps 0: none)."""
    rules: list[tuple[int, str]] = []
    if epochs > 0:
        end = steps_by_epochs(
            step=step, epoch=epoch, epoch_step=epoch_step, steps_per_epoch=steps_per_epoch, epochs=epochs
        )
        rules.append((end, f"--epochs {epochs} x {steps_per_epoch} steps"))
    if max_steps > 0:
        rules.append((max_steps, f"--max-steps {max_steps}"))
    rules.sort(key=lambda rule: rule[0])  # stable: --epochs names the end when both agree
    end, reason = rules[0]
    others = [f"{text} is not reached" for stop, text in rules[1:] if stop > end]
    return Horizon(end, "; ".join([reason, *others]))


def cooldown_steps(cfg: OptimConfig, *, steps_per_epoch: int) -> int:
    return steps_per_epoch * cfg.epochs_cooldown if cfg.lr_scheduler == "const-cooldown" else 0


def lr_at(step: int, cfg: OptimConfig, total_steps: int, *, steps_per_epoch: int = 0) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps` (the horizon's end)."""
    if cfg.skip_scheduler:
        return cfg.lr
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_scheduler == "const":
        return cfg.lr
    if cfg.lr_scheduler == "const-cooldown":
        return _cooldown(step, cfg, total_steps, cooldown_steps(cfg, steps_per_epoch=steps_per_epoch))
    decay_steps = max(1, total_steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / decay_steps)
    return 0.5 * (1 + math.cos(math.pi * progress)) * cfg.lr


def _cooldown(step: int, cfg: OptimConfig, total_steps: int, cooldown: int) -> float:
    start = total_steps - cooldown
    if step < start:
        return cfg.lr
    progress = min(1.0, (step - start) / max(1, cooldown))  # clamped: past the end stays at the end value
    decay = (1 - progress) ** cfg.lr_cooldown_power
    return decay * (cfg.lr - cfg.lr_cooldown_end) + cfg.lr_cooldown_end


def warmup_warning(cfg: OptimConfig, horizon: Horizon, *, step: int, steps_per_epoch: int) -> str | None:
    """A warning when warmup is still under way and lasts to the run's end or past it: the LR never
    reaches --lr (or just at the last step) and never decays. None when the schedule is sound."""
    end = horizon.end_step
    if cfg.skip_scheduler or cfg.warmup <= step or cfg.warmup < end or end <= step:
        return None
    peak = lr_at(end - 1, cfg, end, steps_per_epoch=steps_per_epoch)
    return (
        f"--warmup {cfg.warmup} is not shorter than the run, which ends at step {end} ({horizon.reason}): "
        f"the learning rate rises to {peak:.3g} at most ({peak / cfg.lr:.1%} of --lr {cfg.lr:g}) and never "
        f"decays; pass a --warmup well below {end}"
    )


def schedule_line(cfg: OptimConfig, horizon: Horizon, *, step: int, steps_per_epoch: int) -> str:
    """The log's one line on the schedule: where it starts and ends, and why there."""
    end = horizon.end_step
    if step >= end:  # a requeue after the last save, or --max-steps lowered: not a silent exit
        return (f"schedule: nothing to train: the run is at step {step}, its end is step {end} ({horizon.reason}); "
                "to train on, raise --max-steps or --epochs")  # fmt: skip
    lr = lr_at(step, cfg, end, steps_per_epoch=steps_per_epoch)
    if cfg.skip_scheduler:
        shape = f"--skip-scheduler: LR {cfg.lr:g} throughout"
    else:
        ending = {"cosine": "cosine to 0", "const": "then constant",
                  "const-cooldown": f"cooldown to {cfg.lr_cooldown_end:g} over the last {cfg.epochs_cooldown} epoch(s)"}  # fmt: skip
        shape = f"warmup {cfg.warmup} steps to --lr {cfg.lr:g}, {ending[cfg.lr_scheduler]} at step {end}"
    return f"schedule: steps {step} to {end} ({horizon.reason}); {shape}; LR now {lr:.3g}"


def saved_schedule(horizon: Horizon, *, lr: float) -> dict[str, float]:
    """What a checkpoint's manifest records of the schedule, for the note on resume."""
    return {"end_step": horizon.end_step, "lr": lr}


def resume_note(
    cfg: OptimConfig, horizon: Horizon, saved: dict, *, step: int, steps_per_epoch: int
) -> tuple[str, bool] | None:
    """On resume at `step`: a line when the schedule's horizon moved or its LR does not continue
    the checkpoint's (`saved`, `saved_schedule`'s record), and whether the LR jumps. None when the
    schedule simply continues (or the checkpoint recorded none)."""
    if step < 1 or "end_step" not in saved or "lr" not in saved:
        return None
    old_end, before = int(saved["end_step"]), float(saved["lr"])
    end = horizon.end_step
    # The new schedule, asked about the checkpoint's last step: equal means the LR simply continues.
    jumped = not math.isclose(lr_at(step - 1, cfg, end, steps_per_epoch=steps_per_epoch), before,
                              rel_tol=1e-6, abs_tol=1e-12)  # fmt: skip
    if old_end == end and not jumped:
        return None
    after = lr_at(step, cfg, end, steps_per_epoch=steps_per_epoch)
    moved = f"the run now ends at step {end} ({horizon.reason}), the checkpoint's run at step {old_end}"
    what = (
        moved
        if old_end != end
        else "the schedule's flags differ from the checkpoint's (--lr, --warmup, --lr-scheduler...)"
    )
    change = "jumps" if jumped else "continues"
    return (
        f"LR schedule on resume: {what}; the LR {change} from {before:.3g} (step {step}, the checkpoint's "
        f"last) to {after:.3g} (step {step + 1})",
        jumped,
    )
