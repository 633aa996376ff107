"""Which reader (rank x data worker) reads which shards, for an epoch or the rest of one.

Every rank computes the same assignment from (shards, position, seed, world size, workers), so
no communication is needed. The epoch's shard order is a seeded shuffle of all shards; what
is left of them (partial shards first, so in-progress work finishes early, then the untouched
ones in epoch order) is split among the ranks, then within a rank dealt to its workers.

Every epoch reads every sample once, whatever the world size, worker count and shard sizes,
when sizes.json gives every shard's size (`bigclip index-shards`): the ranks' shares are then
cut from that sequence so that each holds the same number of samples (to one), splitting a
shard at sample level where a share ends inside it (`balanced`; at most world_size - 1 splits,
each a piece [first, stop) of the shard, spans.py). Each rank then fills exactly
samples // (batch_size x world_size) global batches, the planned steps; what is left is less
than one global batch (and what corrupt samples took away, counted in the epoch's log line).
The reader of a split shard's later piece reads the shard from its start, passing over the
earlier samples' data, unless a cursor already knows the byte: up to one shard's prefix per
rank boundary per epoch (LAION at 1024 ranks: ~1,000 of 41k shards, 1% more bytes read).

Without sizes for every shard the plan cannot know where to cut: whole shards are dealt
greedily to the least-loaded rank (load: the samples left, the mean size where unknown), the
epoch ends when the first rank runs out, and the loader logs the shortfall with counts each
epoch (loader.py); validation warns at the start. Within a rank, the workers need no balance
(a worker that finishes leaves the rank's round robin and the others go on), so pieces are
dealt greedily by their sample counts, never split.

With --dataset-resampled the tasks are draws (position.py): the unfinished draws below the
frontier are dealt the same way, then reader g of R (g = rank x readers + worker) continues
with draws frontier + g, frontier + g + R, ... (`Tail`): no draw is read twice, whatever the
world size.

An assignment is made once per stream, from its origin: the epoch's start, or the position a run
resumed from at other settings. A resume at the same settings (stream_state.py) recomputes
the assignment from the saved origin instead of re-dealing what is left, and restarts every reader
where it was; `assign_readers` decides which, and logs why when it cannot continue exactly.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from bigclip.data.resume.position import DataPosition
from bigclip.data.resume.randomness import choose_weighted, draws_key
from bigclip.data.resume.spans import NO_STOP, PieceKey, Span
from bigclip.data.resume.stream_state import RankStream, StreamSettings
from bigclip.data.shards import ShardList
from bigclip.data.tar_samples import Cursor

log = logging.getLogger("bigclip.data")


@dataclass(frozen=True)
class ShardTask:
    shard: int  # index into ShardList.urls; with --dataset-resampled, the draw index
    url: str
    start: Cursor
    size: int | None = None  # samples in the shard (sizes.json), when known
    stop: int | None = None  # read samples [start.index, stop): a piece of a split shard

    @property
    def piece(self) -> PieceKey:
        """How the position names what this task's reader consumes (spans.py)."""
        return (self.shard, self.start.index, NO_STOP if self.stop is None else self.stop)

    @property
    def samples(self) -> int | None:
        return Span(self.start, self.stop).samples(self.size)

    def split(self, n: int) -> tuple[ShardTask, ShardTask]:
        """The first n samples, and the rest (whose byte offset is unknown: read from the shard's start)."""
        cut = self.start.index + n
        return replace(self, stop=cut), replace(self, start=Cursor(cut, -1))


@dataclass(frozen=True)
class Tail:
    """--dataset-resampled: after its plan, a reader takes draws start, start + stride, ..."""

    start: int
    stride: int

    def draw(self, k: int) -> int:
        return self.start + k * self.stride


def draw_shard(shards: ShardList, *, seed: int, epoch: int) -> Callable[[int], int]:
    """The shard index of each draw of the epoch's global sequence."""
    key, cumulative = draws_key(seed=seed, epoch=epoch), shards.cumulative_weights()
    return lambda draw: choose_weighted(key, draw, cumulative)


def epoch_order(num_shards: int, *, seed: int, epoch: int) -> list[int]:
    order = list(range(num_shards))
    # A str seed is hashed with SHA-512: the same shuffle in every process and Python version.
    random.Random(f"bigclip-shards-{seed}-{epoch}").shuffle(order)
    return order


def remaining_tasks(shards: ShardList, position: DataPosition, *, seed: int) -> list[ShardTask]:
    """Unfinished shards (or draws below the frontier), partial ones first."""
    if position.resampled:
        order = list(range(position.draws))
    else:
        order = epoch_order(len(shards), seed=seed, epoch=position.epoch)
    partial = [s for s in order if s in position.spans and s not in position.done]
    untouched = [s for s in order if s not in position.spans and s not in position.done]
    pieces = [(s, span.start, span.stop) for s in partial + untouched for span in position.left(s)]
    return tasks_of(shards, pieces, seed=seed, epoch=position.epoch, resampled=position.resampled)


def balanced(tasks: list[ShardTask], *, world_size: int) -> list[list[ShardTask]]:
    """Cut the tasks, in order, into world_size runs of equal sample counts (to one), splitting
    a task where a run ends inside it. Every task's size must be known."""
    total = sum(t.samples or 0 for t in tasks)
    quotas = [total // world_size + (rank < total % world_size) for rank in range(world_size)]
    ranks: list[list[ShardTask]] = [[] for _ in range(world_size)]
    rank, room = 0, quotas[0]
    for task in tasks:
        while True:
            while room == 0 and rank < world_size - 1:
                rank, room = rank + 1, quotas[rank + 1]
            n = task.samples or 0  # an empty shard is read all the same: sizes.json may be stale
            if n <= room or rank == world_size - 1:
                ranks[rank].append(task)
                room = max(0, room - n)
                break
            head, task = task.split(room)
            ranks[rank].append(head)
            room = 0
    return ranks


def _deal(loads: list[float], items: list[tuple[float, ShardTask]]) -> list[list[ShardTask]]:
    """Greedy: each item, in order, to the least-loaded bin (lowest index on ties)."""
    bins: list[list[ShardTask]] = [[] for _ in loads]
    heap = [(load, i) for i, load in enumerate(loads)]
    heapq.heapify(heap)
    for weight, task in items:
        load, i = heapq.heappop(heap)
        bins[i].append(task)
        heapq.heappush(heap, (load + weight, i))
    return bins


def assign(
    tasks: list[ShardTask], shards: ShardList, *, world_size: int, workers: int, resampled: bool = False
) -> list[list[list[ShardTask]]]:
    """tasks -> plan[rank][worker] = shards that reader reads, in order."""
    known = [s for s in shards.sizes if s is not None]
    mean_size = sum(known) / len(known) if known else 1.0

    def weight(task: ShardTask) -> float:
        samples = task.samples
        return max(float(samples) if samples is not None else mean_size - task.start.index, 1.0)

    if all(t.samples is not None for t in tasks) and not resampled:
        per_rank = balanced(tasks, world_size=world_size)
    else:
        per_rank = _deal([0.0] * world_size, [(weight(t), t) for t in tasks])
    readers = max(1, workers)
    return [_deal([0.0] * readers, [(weight(t), t) for t in rank_tasks]) for rank_tasks in per_rank]


@dataclass
class ReaderAssignment:
    """One rank's readers for a stream: the origin their plan comes from, their shards, where they start."""

    origin: DataPosition
    tasks: list[list[ShardTask]]  # per worker, in reading order
    stream: RankStream  # readers' states, the round robin's place, the re-batcher's carry
    tails: list[Tail | None]  # per worker: the draws after its plan (--dataset-resampled)


def assign_readers(
    shards: ShardList, start: DataPosition, settings: StreamSettings, *, rank: int
) -> ReaderAssignment:
    """The saved stream continued when `settings` match it, else the rest of the epoch re-planned."""
    origin, stream, exact = _continuation(start, settings, rank=rank)
    if exact:
        origin.check_compatible(shards, epoch=start.epoch, resampled=start.resampled)
    remaining = remaining_tasks(shards, origin, seed=settings.seed)
    tasks = assign(
        remaining, shards, world_size=settings.world_size, workers=settings.workers, resampled=start.resampled
    )[rank]
    return ReaderAssignment(origin, tasks, stream, reader_tails(origin, settings, rank=rank))


def reader_tails(origin: DataPosition, settings: StreamSettings, *, rank: int) -> list[Tail | None]:
    """--dataset-resampled: reader g = rank x readers + worker continues with draws frontier + g,
    frontier + g + all readers, ... (None for every reader without it)."""
    readers = settings.readers
    if not origin.resampled:
        return [None] * readers
    stride = settings.world_size * readers
    return [Tail(origin.draws + rank * readers + w, stride) for w in range(readers)]


def tasks_of(
    shards: ShardList, pieces: list[tuple[int, Cursor, int | None]], *, seed: int, epoch: int, resampled: bool
) -> list[ShardTask]:
    """The tasks reading samples [start, stop) of each (shard, start, stop); with --dataset-resampled
    the first is a draw of the epoch."""
    shard_of = draw_shard(shards, seed=seed, epoch=epoch) if resampled else (lambda task: task)
    return [
        ShardTask(task, shards.urls[shard_of(task)], start, shards.sizes[shard_of(task)], stop)
        for task, start, stop in pieces
    ]


def _continuation(
    start: DataPosition, settings: StreamSettings, *, rank: int
) -> tuple[DataPosition, RankStream, bool]:
    """(origin, this rank's stream state, exact): the saved ones, or a fresh stream from `start`."""
    saved = start.stream
    changes = settings.changes_from(saved.settings) if saved is not None else []
    if saved is not None and not changes:
        if rank == 0:
            log.info(
                "data: continuing the saved stream exactly (epoch %d, %d samples in)",
                start.epoch,
                start.samples,
            )
        return DataPosition.from_json(saved.origin), saved.ranks[rank], True
    if rank == 0 and start.samples:
        why = ", ".join(changes) if changes else "the position holds no stream state"
        log.info(
            "data: re-planning the rest of epoch %d over %d x %d readers (%s): every sample once, "
            "but not in the order an uninterrupted run would have used",
            start.epoch, settings.world_size, settings.readers, why,
        )  # fmt: skip
    return start.without_stream(), RankStream.fresh(settings.readers), False
