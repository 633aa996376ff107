"""The consumer side of the workers' batches: their order, and re-batching into exactly `batch_size`.

Order (`WorkerOrder`): the stream is defined as a round robin over the rank's workers, a
worker leaving it after its last batch (which every worker sends, tagged `last`). That is the
order torch's DataLoader delivers batches in, so normally nothing waits; but the order is
taken from the tags, not assumed, so a resumed loader can restart the round robin at any
worker and stay exact whatever order batches arrive in.

Re-batching (`Rebatcher`): workers send full batches, except the last one of each worker,
which is short. Full batches pass through without a copy; the short remainders are joined
here (first in, first out) instead of being dropped per worker, so at most one short
remainder per rank is left at the end of an epoch. Each shard's samples keep their read
order, so what is consumed of a shard stays a prefix. The carry is part of the exact
position: which workers' last batches it holds, oldest first; a resumed loader refetches
those (their readers regenerate just the unconsumed samples) before anything else.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from bigclip.errors import DataError


@dataclass
class Chunk:
    """Consecutive samples of one or more worker batches, with each sample's bookkeeping."""

    images: torch.Tensor  # uint8 [n, H, W, 3]
    erase: torch.Tensor  # long [n, K, 5]: --aug-cfg re_prob boxes (device.py)
    texts: torch.Tensor
    keys: list[str]
    shards: torch.Tensor  # long [n]
    after: torch.Tensor  # long [n, 4]: (index, byte) of the cursor after each sample, its piece (first, stop)
    workers: torch.Tensor  # long [n]: the worker that read each sample
    states: torch.Tensor  # long [n, width]: that worker's ReaderState row just after the sample

    @classmethod
    def of(cls, worker_batch: dict[str, Any]) -> Chunk:
        b = worker_batch
        workers = torch.full((len(b["keys"]),), b["worker"], dtype=torch.long)
        return cls(
            b["images"],
            b["erase"],
            b["texts"],
            list(b["keys"]),
            b["shards"],
            b["after"],
            workers,
            b["states"],
        )

    def __len__(self) -> int:
        return len(self.keys)

    def columns(self) -> list[Any]:
        """The fields in order: tensors, and the keys' list (not copied, unlike `astuple`)."""
        return [getattr(self, f.name) for f in fields(self)]

    def split(self, n: int) -> tuple[Chunk, Chunk]:
        columns = self.columns()
        return Chunk(*(c[:n] for c in columns)), Chunk(*(c[n:] for c in columns))

    @classmethod
    def cat(cls, chunks: list[Chunk]) -> Chunk:
        if len(chunks) == 1:
            return chunks[0]
        return cls(*(_join(parts) for parts in zip(*(c.columns() for c in chunks))))


def _join(parts: tuple[Any, ...]) -> Any:
    """One column of several chunks: tensors concatenated, key lists joined."""
    return [k for keys in parts for k in keys] if isinstance(parts[0], list) else torch.cat(parts)


class WorkerOrder(Iterator[dict[str, Any]]):
    """Worker batches in round-robin order over `active` (the next worker first), from any source order."""

    def __init__(
        self, source: Iterator[dict[str, Any]], *, active: list[int], generation: int | None = None
    ) -> None:
        self.source = source
        self.active = deque(active)  # workers still in the round robin, the next to deliver first
        self.waiting: dict[int, deque[dict[str, Any]]] = defaultdict(deque)  # arrived early
        self.generation = generation  # the epoch start its batches must come from (pool.py)

    def __next__(self) -> dict[str, Any]:
        if not self.active:
            raise StopIteration
        worker = self.active.popleft()
        batch = self.next_from(worker)
        if not batch["last"]:
            self.active.append(worker)
        return batch

    def next_from(self, worker: int) -> dict[str, Any]:
        """`worker`'s next batch, keeping what other workers send meanwhile."""
        while not self.waiting[worker]:
            batch = next(self.source, None)
            if batch is None:
                raise RuntimeError(f"data worker {worker} stopped without sending its last batch")
            if self.generation is not None and batch.get("generation") != self.generation:
                # The pool drains a previous epoch's batches before the next starts: one here
                # would put another epoch's samples into this one.
                raise RuntimeError(
                    f"data worker {batch['worker']} sent a batch of epoch start {batch.get('generation')} "
                    f"during epoch start {self.generation}"
                )
            self.waiting[batch["worker"]].append(batch)
        return self.waiting[worker].popleft()

    def close(self) -> None:
        """Drop the source (so the DataLoader's workers shut down); the order stays readable."""
        self.source = iter(())
        self.waiting.clear()


class Rebatcher:
    def __init__(self, batch_size: int, *, on_chunk: Callable[[dict[str, Any]], None]) -> None:
        self.batch_size = batch_size
        self.on_chunk = on_chunk  # sees every worker batch's bookkeeping as it arrives
        self.carry: deque[Chunk] = deque()
        self.carried = 0

    def next_batch(self, source: Iterator[dict[str, Any]]) -> Chunk | None:
        """Exactly batch_size samples, or None when the source runs out first (the carry is kept)."""
        while self.carried < self.batch_size:
            worker_batch = next(source, None)
            if worker_batch is None:
                return None
            chunk = self.receive(worker_batch)
            if len(chunk) == self.batch_size:
                # Full batches overtake the carry: a short one is the *last* of its worker, so
                # no shard has samples in both and every shard's samples stay in read order.
                return chunk
            if len(chunk):
                self.carry.append(chunk)
                self.carried += len(chunk)
        return self._take(self.batch_size)

    def receive(self, worker_batch: dict[str, Any]) -> Chunk:
        self.on_chunk(worker_batch)
        return Chunk.of(worker_batch)

    def refill(self, worker_batch: dict[str, Any]) -> None:
        """Put a refetched short last batch back into the carry (resume: oldest first)."""
        if not worker_batch["last"]:
            # Its reader regenerated more than the rest of its last batch: the same shard names
            # now hold other samples. Carrying on would break the order that keeps resume exact.
            raise DataError(
                f"data worker {worker_batch['worker']} read more after the checkpoint than before it: the "
                "shards' contents changed since the checkpoint was saved. Restore the shards, or resume "
                "with another --workers to re-plan the rest of the epoch"
            )
        chunk = self.receive(worker_batch)
        if len(chunk):
            self.carry.append(chunk)
            self.carried += len(chunk)

    def carry_workers(self) -> list[int]:
        """Whose last batches the carry holds (partly consumed ones included), oldest first."""
        return [int(chunk.workers[0]) for chunk in self.carry]

    def _take(self, n: int) -> Chunk:
        parts: list[Chunk] = []
        while n:
            chunk = self.carry.popleft()
            if len(chunk) > n:
                chunk, rest = chunk.split(n)
                self.carry.appendleft(rest)
            parts.append(chunk)
            n -= len(chunk)
        self.carried -= sum(len(p) for p in parts)
        return Chunk.cat(parts)
