"""What each data worker is handed when an epoch starts, and the board it is handed on.

The workers are started once for the run (pool.py), so an epoch's readers cannot be baked into
the dataset object they were forked with: the loader posts one `ReaderJob` per worker on the
`JobBoard` (a queue per worker, shared with them when they start) and then starts the epoch's
iteration; each worker's stream takes its job when the epoch's first batch is asked of it.

Jobs carry a generation (the how-manieth epoch start on these workers). The board publishes the
latest one before posting, and a worker takes jobs until it holds that one, keeping it: should a
request left over from the previous epoch start a stream after the next epoch was posted (torch
drains such batches, pool.py), that stream and the epoch's real one read the same job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bigclip.data.resume.assignment import ReaderAssignment, ShardTask, Tail
from bigclip.data.resume.randomness import draws_key, stream_key
from bigclip.data.resume.reader_state import ReaderState


@dataclass
class ReaderSpec:
    """One reader: its worker index on this rank, the key of its random choices, its shards, its start."""

    worker: int
    key: str  # randomness.stream_key(...)
    plan: list[ShardTask]  # shards (draws, with --dataset-resampled) to read in order
    state: ReaderState = field(default_factory=ReaderState)
    tail: Tail | None = None  # --dataset-resampled: the draws to read after the plan, endlessly


@dataclass(frozen=True)
class ReaderJob:
    """One worker's part of an epoch (or of the rest of one), handed to it when the epoch starts."""

    generation: int  # which epoch start on these workers: 1, 2, ...
    reader: ReaderSpec | None  # None: nothing to read this time (its readers have all finished)
    crop_key: str  # (seed, epoch): with (shard, sample index), keys a sample's crop
    draws_key: str  # --dataset-resampled: which shard each draw is
    open_at: float = 0.0  # time.monotonic() before which the reader opens no shard (open_schedule.py)


def reader_specs(assignment: ReaderAssignment, *, seed: int, epoch: int, rank: int) -> list[ReaderSpec]:
    """Data worker i runs the i-th: the carry's readers first, then the round robin from its next
    worker, so that the DataLoader's own round robin already delivers batches in stream order."""
    origin, stream = assignment.origin.samples, assignment.stream
    return [
        ReaderSpec(
            worker=w,
            key=stream_key(seed=seed, epoch=epoch, origin=origin, rank=rank, worker=w),
            plan=assignment.tasks[w],
            state=stream.readers[w],
            tail=assignment.tails[w],
        )
        for w in stream.carry + stream.active
    ]


def epoch_jobs(
    specs: list[ReaderSpec], *, generation: int, seed: int, epoch: int, open_at: list[float]
) -> list[ReaderJob]:
    """One job per worker slot (`open_at` has one time per slot); slots past the readers still
    unfinished get nothing to read."""
    crop_key, draws = f"bigclip-crop/{seed}/{epoch}", draws_key(seed=seed, epoch=epoch)
    padded: list[ReaderSpec | None] = [*specs, *[None] * (len(open_at) - len(specs))]
    return [ReaderJob(generation, spec, crop_key, draws, at) for spec, at in zip(padded, open_at)]


class JobBoard:
    """Jobs for `workers` worker processes (queues made in `context`), or for the training process itself."""

    def __init__(self, workers: int, context: Any = None) -> None:
        self.queues = [context.Queue() for _ in range(workers)] if workers else []
        self.latest = context.RawValue("q", 0) if workers else None  # the generation posted last
        self.local: list[ReaderJob] = []  # --workers 0: read in this process
        self._held: ReaderJob | None = None  # in a worker: the job it took last

    def post(self, jobs: list[ReaderJob]) -> None:
        """Hand out an epoch's jobs, the i-th to worker i (in the training process: before iterating)."""
        if not self.queues:
            self.local = list(jobs)
            return
        if len(jobs) != len(self.queues):
            raise ValueError(f"{len(jobs)} jobs for {len(self.queues)} data workers")
        self.latest.value = jobs[0].generation
        for queue, job in zip(self.queues, jobs):
            queue.put(job)

    def take(self, worker: int) -> ReaderJob:
        """Worker `worker`'s job for the epoch posted last (blocks until it arrives)."""
        if not self.queues:
            return self.local[worker]
        wanted = self.latest.value
        while self._held is None or self._held.generation < wanted:
            self._held = self.queues[worker].get()
        return self._held

    def close(self) -> None:
        for queue in self.queues:
            queue.cancel_join_thread()  # a job no worker took must not hold this process at exit
            queue.close()
