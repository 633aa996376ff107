"""One schedule horizon (issue 38, item 4): the step where the run actually ends, the earliest of
--epochs and --max-steps from where the run stands, for the LR schedule, the ETA and the log; a
warning when warmup outlasts the run; a note when a resume moves the schedule. (The LR formulas
against OpenCLIP's own scheduler: test_config.py; a real run's log line and last LR:
test_stop_signals.py.)"""

from __future__ import annotations

import math

import pytest

from bigclip.cli_args import parse_train_args
from bigclip.train.schedule import (
    Horizon,
    lr_at,
    resume_note,
    run_horizon,
    saved_schedule,
    schedule_line,
    warmup_warning,
)


def horizon(*, step=0, epoch=0, epoch_step=0, steps_per_epoch=31, epochs=5, max_steps=0) -> Horizon:
    return run_horizon(step=step, epoch=epoch, epoch_step=epoch_step, steps_per_epoch=steps_per_epoch,
                       epochs=epochs, max_steps=max_steps)  # fmt: skip


def optim(*flags: str):
    return parse_train_args(["--lr", "4e-4", *flags]).optim


def test_the_earliest_stopping_rule_ends_the_run():
    assert horizon(epochs=5, max_steps=200) == Horizon(
        155, "--epochs 5 x 31 steps; --max-steps 200 is not reached"
    )
    assert horizon(epochs=5, max_steps=100) == Horizon(
        100, "--max-steps 100; --epochs 5 x 31 steps is not reached"
    )
    assert horizon(epochs=5) == Horizon(155, "--epochs 5 x 31 steps")
    assert horizon(epochs=5, max_steps=155).end_step == 155  # both agree: the epochs say it
    assert horizon(epochs=0, max_steps=40) == Horizon(40, "--max-steps 40")  # --epochs < 1: no epoch limit


def test_a_resumed_run_counts_what_is_left_from_where_it_stands():
    # Mid-epoch 2 (10 of 31 steps into it): 21 left in it, then 2 whole epochs.
    assert horizon(step=72, epoch=2, epoch_step=10).end_step == 72 + 21 + 2 * 31 == 155
    # Resumed at another global batch (--allow-batch-size-change): 40 steps per epoch from here.
    assert horizon(step=62, epoch=2, steps_per_epoch=40).end_step == 62 + 3 * 40
    assert horizon(step=155, epoch=5).end_step == 155  # finished: nothing left
    assert horizon(step=30, epoch=0, epoch_step=35, steps_per_epoch=31, epochs=1).end_step == 30


def test_the_lr_schedule_ends_where_the_run_does():
    cfg, end = (
        optim("--warmup", "10", "--epochs", "5", "--max-steps", "200"),
        horizon(epochs=5, max_steps=200).end_step,
    )
    assert lr_at(end - 1, cfg, end) == pytest.approx(0.5 * (1 + math.cos(math.pi * 144 / 145)) * 4e-4)
    assert lr_at(end - 1, cfg, end) < 1e-7 < lr_at(end - 1, cfg, 200)  # the old horizon left it far from 0
    line = schedule_line(cfg, horizon(epochs=5, max_steps=200), step=0, steps_per_epoch=31)
    assert "steps 0 to 155 (--epochs 5 x 31 steps; --max-steps 200 is not reached)" in line
    assert "cosine to 0 at step 155" in line
    # resumed at its end (a requeue after the last save): the line says there is nothing to train
    done = schedule_line(cfg, horizon(step=200, epoch=6, max_steps=200), step=200, steps_per_epoch=31)
    assert (
        done.startswith("schedule: nothing to train: the run is at step 200, its end is step 200")
        and "raise --max-steps" in done
    )


def test_warmup_longer_than_the_run_is_warned_once_and_not_otherwise():
    run = horizon(epochs=5)  # 155 steps
    text = warmup_warning(optim("--warmup", "10000"), run, step=0, steps_per_epoch=31)
    assert text is not None and "--warmup 10000 is not shorter than the run, which ends at step 155" in text
    assert f"rises to {4e-4 * 155 / 10000:.3g} at most (1.6% of --lr 0.0004)" in text
    assert (
        warmup_warning(optim("--warmup", "155"), run, step=0, steps_per_epoch=31) is not None
    )  # never decays
    assert warmup_warning(optim("--warmup", "154"), run, step=0, steps_per_epoch=31) is None
    assert (
        warmup_warning(optim("--warmup", "10000", "--skip-scheduler"), run, step=0, steps_per_epoch=31)
        is None
    )
    # Resumed past the warmup: nothing left to warn about.
    assert warmup_warning(optim("--warmup", "200"), horizon(step=120, epoch=3, epochs=5, steps_per_epoch=40),
                          step=210, steps_per_epoch=40) is None  # fmt: skip


def test_a_resume_that_moves_the_horizon_notes_the_lr_jump():
    """The issue's case: 2 epochs trained (cosine nearly at 0), resumed with --epochs 3."""
    cfg = optim("--warmup", "10", "--epochs", "3")
    old, new = horizon(epochs=2), horizon(step=62, epoch=2, epochs=3)
    saved = saved_schedule(old, lr=lr_at(61, cfg, old.end_step))
    line, jumped = resume_note(cfg, new, saved, step=62, steps_per_epoch=31)
    assert jumped and new.end_step == 93
    before, after = lr_at(61, cfg, 62), lr_at(62, cfg, 93)
    assert before < 1e-6 < 1e-4 < after
    assert "the run now ends at step 93 (--epochs 3 x 31 steps), the checkpoint's run at step 62" in line
    assert f"the LR jumps from {before:.3g} (step 62, the checkpoint's last) to {after:.3g} (step 63)" in line


def test_a_resume_that_continues_the_schedule_says_nothing_and_a_changed_flag_is_noted():
    cfg = optim("--warmup", "10", "--epochs", "5")
    run, mid = horizon(epochs=5), horizon(step=62, epoch=2, epochs=5)
    saved = saved_schedule(run, lr=lr_at(61, cfg, 155))
    assert resume_note(cfg, mid, saved, step=62, steps_per_epoch=31) is None
    assert resume_note(cfg, mid, {}, step=62, steps_per_epoch=31) is None  # an older checkpoint: no record
    changed = optim("--warmup", "10", "--epochs", "5", "--lr", "1e-3")
    line, jumped = resume_note(changed, mid, saved, step=62, steps_per_epoch=31)
    assert jumped and "the schedule's flags differ from the checkpoint's" in line
    # A horizon that moves while the LR is constant (still warming up): noted, no jump.
    warm = optim("--warmup", "100", "--epochs", "5")
    line, jumped = resume_note(warm, mid, saved_schedule(horizon(epochs=2), lr=lr_at(61, warm, 62)), step=62,
                               steps_per_epoch=31)  # fmt: skip
    assert not jumped and "the LR continues from" in line
