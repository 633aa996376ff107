"""Re-batching worker output into exactly `batch_size` samples, in the consumer process.

Workers send full batches, except the last one of each worker, which is short. Full
batches pass through without a copy; the short remainders are joined here (first in, first
out) instead of being dropped per worker, so at most one short remainder per rank is left
at the end of an epoch. Each shard's samples keep their read order, so what is consumed of
a shard stays a prefix.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Chunk:
    """Consecutive samples of one or more worker batches, with each sample's shard and next cursor."""

    images: torch.Tensor
    texts: torch.Tensor
    keys: list[str]
    shards: torch.Tensor  # long [n]
    after: torch.Tensor  # long [n, 2]: (index, byte) of the cursor after each sample

    @classmethod
    def of(cls, worker_batch: dict[str, Any]) -> Chunk:
        b = worker_batch
        return cls(b["images"], b["texts"], list(b["keys"]), b["shards"], b["after"])

    def __len__(self) -> int:
        return len(self.keys)

    def split(self, n: int) -> tuple[Chunk, Chunk]:
        head = Chunk(self.images[:n], self.texts[:n], self.keys[:n], self.shards[:n], self.after[:n])
        tail = Chunk(self.images[n:], self.texts[n:], self.keys[n:], self.shards[n:], self.after[n:])
        return head, tail

    @classmethod
    def cat(cls, chunks: list[Chunk]) -> Chunk:
        if len(chunks) == 1:
            return chunks[0]
        return cls(
            torch.cat([c.images for c in chunks]),
            torch.cat([c.texts for c in chunks]),
            [k for c in chunks for k in c.keys],
            torch.cat([c.shards for c in chunks]),
            torch.cat([c.after for c in chunks]),
        )


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
            self.on_chunk(worker_batch)
            chunk = Chunk.of(worker_batch)
            if len(chunk) == self.batch_size:
                # Full batches overtake the carry: a short one is the *last* of its worker, so
                # no shard has samples in both and every shard's samples stay in read order.
                return chunk
            if len(chunk):
                self.carry.append(chunk)
                self.carried += len(chunk)
        return self._take(self.batch_size)

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
