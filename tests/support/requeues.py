"""What a user relies on when a Slurm job is requeued, read from its output and its files, without
counting requeues where timing can add one. On a loaded box a job can be requeued again for
reasons that are Slurm's, not bigclip's: a kill that Slurm retries at a node that answered late
reaches the rerun (it has the same job id), a late preemptor signals the rerun as it starts. The
run must come through those too, so the tests check, for every run of the job:

- it was requeued (at least once), the first time for the expected reason;
- each rerun resumed exactly where the run before it stopped: at the step a stop signal made it
  checkpoint, or at its last periodic checkpoint after a hang or a lost node (stuck ranks cannot
  checkpoint);
- nothing was lost: every rank trained every step, on an uninterrupted run's batches (the tests
  compare the batch keys);
- the job ended as it should (COMPLETED, or CANCELLED when the test stopped it), with its last
  checkpoint committed.

A run is what the batch script prints from its first line ("bigclip sbatch: job J, restart K").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

RUN = re.compile(r"^bigclip sbatch: job \d+, restart (\d+)", re.MULTILINE)
STOP = re.compile(r"the ranks stopped and asked for a requeue \((\{.*\})\)")
RESUMED = re.compile(r"resumed \S+ at step (\d+)")
REQUEUED_BY = re.compile(r"bigclip sbatch: (requeued job|SLURM has requeued this job already)")


@dataclass(frozen=True)
class Run:
    """One run of a job (the first, or a rerun after a requeue): its part of the output."""

    restart: int
    text: str

    @property
    def stop(self) -> dict | None:
        """The requeue marker the run's ranks left, as the script printed it (None: none)."""
        m = STOP.search(self.text)
        return json.loads(m.group(1)) if m else None

    @property
    def resumed_at(self) -> int | None:
        m = RESUMED.search(self.text)
        return int(m.group(1)) if m else None

    @property
    def requeued_by(self) -> str | None:
        m = REQUEUED_BY.search(self.text)
        return m.group(1) if m else None


def runs(out: str) -> list[Run]:
    """The job's runs in order, split where the batch script starts again."""
    starts = list(RUN.finditer(out))
    ends = [m.start() for m in starts[1:]] + [len(out)]
    return [Run(int(m.group(1)), out[m.start() : end]) for m, end in zip(starts, ends)]


def stops(out: str) -> list[dict]:
    return [run.stop for run in runs(out) if run.stop is not None]


def checkpointed_at(stop: dict, *, save_every: int) -> int:
    """Where a stopped run's checkpoint is: the step itself for a signal (the ranks finish the step
    and save it), the last periodic save before a hang or a lost node."""
    if stop["reason"] == "preempted":
        return stop["step"]
    return stop["step"] // save_every * save_every


def assert_requeued_and_resumed_exactly(
    out: str, state: dict[str, str], *, save_every: int, final: str
) -> list[Run]:
    """The job ended `final` after at least one requeue; every rerun resumed where the run before
    it left its checkpoint. Returns the runs (the first one's stop is the fault under test).

    A run with no stop record (one stopped before its ranks could leave one) says nothing of where
    the next one resumes, beyond "not before the last known checkpoint"."""
    every = runs(out)
    tail = f"{state}\n{out[-4000:]}"
    assert state.get("JobState") == final, tail
    restarts = int(state.get("Restarts", "0"))
    assert restarts >= 1 and 2 <= len(every) <= 1 + restarts, tail
    assert every[0].stop is not None, tail
    expected, floor = None, 0
    for run in every:
        if run.restart and run.resumed_at is not None:
            assert run.resumed_at >= floor, (
                f"restart {run.restart} resumed at {run.resumed_at}, before {floor}\n{tail}"
            )
            if expected is not None:
                assert run.resumed_at == expected, (
                    f"restart {run.restart} resumed at {run.resumed_at}, not {expected}\n{tail}"
                )
        expected = None
        if run.stop is not None and run.stop.get("step") is not None:
            expected = floor = checkpointed_at(run.stop, save_every=save_every)
    assert all(run.requeued_by for run in every[:-1]), tail  # each run but the last was followed by a rerun
    assert "DataLoader worker" not in out, tail
    return every


def assert_committed(checkpoints: Path, step: int, *, newer_allowed: bool = False) -> None:
    """The job's last checkpoint, at `step`, is committed (what the next job would resume from).
    `newer_allowed`: a rerun Slurm started after that stop (a kill retried at a node that answered
    late requeues once more on a loaded box) may have trained and committed past it."""
    from bigclip.checkpoint import CheckpointStore

    committed = [s for s, _ in CheckpointStore(str(checkpoints)).committed()]
    newest_ok = committed and (committed[0] >= step if newer_allowed else committed[0] == step)
    assert newest_ok and step in committed, (
        f"{checkpoints}: committed steps {committed}, expected {step} last"
    )
