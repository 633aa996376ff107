"""What runs in each data-loader worker: read its shards, decode, transform, batch.

A worker (one reader of the plan) keeps `interleave` shards open and takes each next
sample from a randomly chosen one. This mixes samples without a shuffle buffer, which
matters for exact resume: a shuffle buffer would consume shards out of order, while here
every shard is still read front to back, so its consumed part stays a prefix.

Each batch carries, besides images / token ids / keys, the bookkeeping the consumer needs:
every sample's shard and the cursor just after it, the shards found to have no valid sample
left (`ends`), and counts of skipped samples by reason. The last batch of a worker may be
short, or even empty but for that bookkeeping; the consumer re-batches.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from bigclip.data.decode import decode_sample
from bigclip.data.plan import ShardTask
from bigclip.data.tar_samples import Cursor, RawSample, ShardSamples
from bigclip.data.tokenizer import Tokenizer
from bigclip.s3 import S3Settings

log = logging.getLogger("bigclip.data")

LOGGED_SKIPS_PER_WORKER = 5  # then counts only: the training loop logs totals
MAX_FRUITLESS_DRAWS = 100  # --dataset-resampled: give up after this many useless shards in a row


@dataclass
class _OpenShard:
    task: ShardTask
    reader: ShardSamples
    samples: Iterator[RawSample]
    last_valid: Cursor  # cursor after the last sample that decoded (the start if none yet)


@dataclass
class _Pending:
    """A batch being filled, plus bookkeeping to send with it."""

    images: list[torch.Tensor] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    shards: list[int] = field(default_factory=list)
    after: list[list[int]] = field(default_factory=list)
    ends: dict[int, list[int]] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)

    def has_news(self) -> bool:
        return bool(self.keys or self.ends or self.skipped or self.broken)


class ReaderStream(IterableDataset):
    """An IterableDataset whose worker `w` reads `plan[w]` (or draws shards forever, when resampled)."""

    def __init__(
        self,
        *,
        plan: list[list[ShardTask]],
        draw: Callable[[random.Random], ShardTask] | None,
        batch_size: int,
        interleave: int,
        transform: Callable[..., torch.Tensor],
        tokenizer: Tokenizer,
        seed: str,
        s3: S3Settings | None,
    ) -> None:
        self.plan = plan
        self.draw = draw  # set for --dataset-resampled: an endless stream of drawn shards
        self.batch_size = batch_size
        self.interleave = interleave
        self.transform = transform
        self.tokenizer = tokenizer
        self.seed = seed
        self.s3 = s3

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        rng = random.Random(f"{self.seed}-worker-{worker}")
        self._logged_skips = 0
        self._fruitless = 0  # shards in a row closed without one valid sample
        for pending in self._batches(self._tasks(worker, rng), rng):
            yield self._emit(pending)

    def _tasks(self, worker: int, rng: random.Random) -> Iterator[ShardTask]:
        if self.draw is None:
            yield from self.plan[worker] if worker < len(self.plan) else ()
            return
        while self._fruitless < MAX_FRUITLESS_DRAWS:
            yield self.draw(rng)
        # An endless stream of unreadable shards would hang the run; ending it lets the loader
        # stop every rank and report the skip counts instead.
        log.error("%d drawn shards in a row held no valid sample; stopping this data worker", self._fruitless)

    def _open(self, task: ShardTask) -> _OpenShard:
        reader = ShardSamples(task.url, start=task.start, s3=self.s3)
        return _OpenShard(task, reader, iter(reader), last_valid=task.start)

    def _batches(self, tasks: Iterator[ShardTask], rng: random.Random) -> Iterator[_Pending]:
        """Full batches, then whatever is left (short, or only bookkeeping) when the shards run out."""
        open_shards: list[_OpenShard] = []
        pending = _Pending()
        while True:
            while len(open_shards) < self.interleave and (task := next(tasks, None)) is not None:
                open_shards.append(self._open(task))
            if not open_shards:
                break
            which = rng.randrange(len(open_shards))
            current = open_shards[which]
            raw = next(current.samples, None)
            if raw is None:
                del open_shards[which]
                self._close(current, pending)
                continue
            self._add(raw, current, pending, rng)
            if len(pending.keys) == self.batch_size:
                yield pending
                pending = _Pending()
        if pending.has_news():
            yield pending

    def _close(self, shard: _OpenShard, pending: _Pending) -> None:
        pending.ends[shard.task.shard] = shard.last_valid.to_json()
        self._fruitless = self._fruitless + 1 if shard.last_valid == shard.task.start else 0
        if shard.reader.error:
            pending.broken.append(shard.task.url)
            log.warning("shard %s ends early, keeping what was read: %s", shard.task.url, shard.reader.error)

    def _add(self, raw: RawSample, shard: _OpenShard, pending: _Pending, rng: random.Random) -> None:
        decoded = decode_sample(raw)
        if isinstance(decoded, str):
            pending.skipped[decoded] += 1
            self._log_skip(decoded, raw, shard.task.url)
            return
        shard.last_valid = raw.after
        pending.images.append(self.transform(decoded.image, rng))
        pending.captions.append(decoded.caption)
        pending.keys.append(raw.key)
        pending.shards.append(shard.task.shard)
        pending.after.append(raw.after.to_json())

    def _log_skip(self, reason: str, raw: RawSample, url: str) -> None:
        self._logged_skips += 1
        if self._logged_skips <= LOGGED_SKIPS_PER_WORKER:
            log.warning("skipping sample %r of %s: %s", raw.key, url, reason)

    def _emit(self, pending: _Pending) -> dict[str, Any]:
        empty = not pending.keys
        return {
            "images": torch.stack(pending.images) if not empty else torch.empty(0),
            "texts": self.tokenizer(pending.captions) if not empty else torch.empty(0, dtype=torch.long),
            "keys": pending.keys,
            "shards": torch.tensor(pending.shards, dtype=torch.long),
            "after": torch.tensor(pending.after, dtype=torch.long).reshape(-1, 2),
            "ends": pending.ends,
            "skipped": dict(pending.skipped),
            "broken": pending.broken,
        }
