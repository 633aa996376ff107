"""What runs in each data-loader worker: read its shards, decode, transform, batch.

A reader (one per data worker) keeps `interleave` shards open and takes each next sample
from one of them chosen at random. This mixes samples without a shuffle buffer, which
matters for exact resume: a shuffle buffer would consume shards out of order, while here
every shard is still read front to back, so its consumed part stays a prefix.

Every random choice is keyed by position (randomness.py): the n-th interleave choice by the
reader's key and n, a sample's crop by (seed, epoch, shard, sample index). A reader started
from a `ReaderState` (reader_state.py) therefore continues the very stream it was on.

Images leave the worker as uint8 [B, H, W, 3], written straight into a batch buffer that
is already in shared memory (so sending it to the training process copies nothing); the
device normalises them (device.py). Each batch also says how long the worker was busy making
it (`busy_s`, excluding time spent waiting for the consumer): the loader's capacity.

Each batch carries, besides images / token ids / keys, the bookkeeping the consumer needs:
the worker it comes from and whether it is that worker's last; every sample's shard, piece
(first, stop) and the cursor just after it, and the reader's state just after it; the pieces
found to have no valid sample left (`ends`); counts of skipped samples by reason; and the
shards found damaged (`broken`), empty, or holding another count than sizes.json lists
(`mismatched`), so that nothing is lost in silence. A worker's batches end where its
count of emitted samples reaches a multiple of batch_size, so the last batch may be short,
or even empty but for that bookkeeping; the consumer re-batches.

The workers live for the whole run (pool.py): a `ReaderStream` holds what does not change
between epochs (shards, transform, tokenizer), and each epoch's part, a `ReaderJob` per worker
(its reader, the epoch's keys, when it may open its first shard), reaches the worker through
the job board when the epoch starts.
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from bigclip.data.accounting import MORE_THAN_LISTED
from bigclip.data.augment import erase_boxes
from bigclip.data.decode import BAD_IMAGE, DEFAULT_KEYS, SampleKeys, decode_sample
from bigclip.data.jobs import JobBoard, ReaderJob
from bigclip.data.resume.assignment import ShardTask
from bigclip.data.resume.randomness import choose, choose_weighted, keyed_rng
from bigclip.data.resume.reader_state import OpenShardState, ReaderState, encode_row
from bigclip.data.resume.spans import NO_STOP
from bigclip.data.tar_samples import START, Cursor, RawSample, ShardSamples
from bigclip.data.tokenizer import Tokenizer
from bigclip.data.transforms import TrainTransform
from bigclip.storage.settings import StorageState

log = logging.getLogger("bigclip.data")

LOGGED_SKIPS_PER_WORKER = 5  # then counts only: the training loop logs totals
MAX_FRUITLESS_DRAWS = 100  # --dataset-resampled: give up after this many useless shards in a row


@dataclass
class _OpenShard:
    shard: int
    first: int  # the piece read: samples [first, stop) of the shard
    stop: int | None
    reader: ShardSamples
    samples: Iterator[RawSample]
    read: Cursor  # where the next sample starts
    valid: Cursor  # cursor after the last sample that decoded (where it was opened if none yet)
    fruitful: bool = False  # a valid sample came from it since it was opened


class _Pending:
    """A batch being filled, plus bookkeeping to send with it."""

    def __init__(self, batch_size: int, image_size: int, *, erase: int) -> None:
        self.images = torch.empty((batch_size, image_size, image_size, 3), dtype=torch.uint8)
        if get_worker_info() is not None:
            self.images.share_memory_()  # pickled to the training process by handle, not copied
        self.erase = torch.zeros((batch_size, erase, 5), dtype=torch.long)  # (top, left, h, w, seed)
        self.captions: list[str] = []
        self.keys: list[str] = []
        self.shards: list[int] = []
        self.after: list[list[int]] = []
        self.states: list[list[int]] = []
        self.ends: list[list[int]] = []  # [shard, first, stop, index, byte]: a piece's reader closed it there
        self.skipped: Counter = Counter()
        self.broken: list[str] = []
        self.empty: list[str] = []
        self.mismatched: dict[str, list[int]] = {}  # url -> [samples found, sizes.json's count]
        self.started = time.perf_counter()


class ReaderStream(IterableDataset):
    """An IterableDataset whose data worker `i` runs, each epoch, the i-th job posted on `board`."""

    def __init__(
        self,
        *,
        urls: tuple[str, ...],
        resampled: bool,
        batch_size: int,
        interleave: int,
        transform: TrainTransform,
        tokenizer: Tokenizer,
        cumulative: list[float] | None = None,
        keys: SampleKeys = DEFAULT_KEYS,
        sizes: tuple[int | None, ...] = (),
    ) -> None:
        self.urls = urls
        self.sizes = sizes  # sizes.json's counts, per shard (None where unknown)
        self.resampled = resampled  # tasks are draws of shards with replacement, endlessly
        self.cumulative = cumulative  # draw weights: which shard each draw is
        self.batch_size = batch_size
        self.interleave = interleave
        self.transform = transform
        self.tokenizer = tokenizer
        self.keys = keys  # --image-key / --text-key
        self.storage = StorageState.capture()  # restored in the worker: a spawned one starts without it
        self.board: JobBoard = JobBoard(0)  # pool.py gives it the workers' board

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.storage.restore()
        info = get_worker_info()
        job = self.board.take(info.id if info is not None else 0)
        if job.reader is not None:
            yield from Reader(self, job).batches()


class Reader:
    """One reader's mutable state while it runs, in its data worker."""

    def __init__(self, stream: ReaderStream, job: ReaderJob) -> None:
        assert job.reader is not None
        self.stream, self.job, self.spec = stream, job, job.reader
        start = self.spec.state
        self.draws, self.tasks, self.emitted = start.draws, start.tasks, start.emitted
        self.fruitless = start.fruitless
        self.open = [self._reopen(s) for s in start.open]
        self.width = ReaderState.width(stream.interleave)
        self.logged_skips = 0
        self.erase = stream.transform.aug.re_count if stream.transform.aug.re_prob else 0

    def _pending(self) -> _Pending:
        return _Pending(self.stream.batch_size, self.stream.transform.image_size, erase=self.erase)

    def url(self, task: int) -> str:
        """The shard a task id names: the shard itself, or the shard drawn at that draw."""
        return self.stream.urls[self.shard_of(task)]

    def shard_of(self, task: int) -> int:
        stream = self.stream
        return task if not stream.resampled else choose_weighted(self.job.draws_key, task, stream.cumulative)

    def size(self, task: int) -> int | None:
        return self.stream.sizes[self.shard_of(task)] if self.stream.sizes else None

    def batches(self) -> Iterator[dict[str, Any]]:
        """Batches ending at multiples of batch_size emitted samples, then the last (short or empty) one."""
        wait = self.job.open_at - time.monotonic()
        if wait > 0:  # the epoch's first opens are spread over its first seconds (open_schedule.py)
            time.sleep(wait)
        pending = self._pending()
        while self._fill():
            which = choose(self.spec.key, self.draws, len(self.open))
            self.draws += 1
            current = self.open[which]
            raw = next(current.samples, None)
            if raw is None:
                del self.open[which]
                self._close(current, pending)
                continue
            current.read = raw.after
            self._check_listed(raw, current, pending)
            if self._add(raw, current, pending) and self.emitted % self.stream.batch_size == 0:
                yield self._emit(pending, last=False)
                pending = self._pending()
        if self.stream.resampled and self.fruitless >= MAX_FRUITLESS_DRAWS:
            # An endless stream of unreadable shards would hang the run; ending it lets the loader
            # stop every rank and report the skip counts instead.
            log.error(
                "%d drawn shards in a row held no valid sample; stopping this data worker", self.fruitless
            )
        yield self._emit(pending, last=True)

    def _fill(self) -> bool:
        """Open shards up to `interleave`; False when none is left open."""
        while len(self.open) < self.stream.interleave and (task := self._next_task()) is not None:
            reader = ShardSamples(task.url, start=task.start, stop=task.stop)
            piece = (task.shard, task.start.index, task.stop)
            self.open.append(_OpenShard(*piece, reader, iter(reader), read=task.start, valid=task.start))
        return bool(self.open)

    def _next_task(self) -> ShardTask | None:
        plan, tail = self.spec.plan, self.spec.tail
        if self.tasks < len(plan):
            task = plan[self.tasks]
        elif tail is None or self.fruitless >= MAX_FRUITLESS_DRAWS:
            return None
        else:
            draw = tail.draw(self.tasks - len(plan))
            task = ShardTask(draw, self.url(draw), START)
        self.tasks += 1
        return task

    def _reopen(self, state: OpenShardState) -> _OpenShard:
        url = self.url(state.shard)
        reader = ShardSamples(url, start=state.read, stop=state.stop)
        piece = (state.shard, state.first, state.stop)
        return _OpenShard(*piece, reader, iter(reader), state.read, state.valid, state.fruitful)

    def _close(self, shard: _OpenShard, pending: _Pending) -> None:
        stop = NO_STOP if shard.stop is None else shard.stop
        pending.ends.append([shard.shard, shard.first, stop, *shard.valid.to_json()])
        self.fruitless = 0 if shard.fruitful else self.fruitless + 1
        url = self.url(shard.shard)
        if shard.reader.error:
            pending.broken.append(url)
            log.warning("shard %s ends early, keeping what was read: %s", url, shard.reader.error)
            return
        self._check_count(shard, url, pending)

    def _check_count(self, shard: _OpenShard, url: str, pending: _Pending) -> None:
        """Report an empty shard, or one whose samples are not what sizes.json says (the plan's basis)."""
        found, size = shard.reader.end_index, self.size(shard.shard)
        if shard.first == 0 and shard.stop is None and found == 0:
            pending.empty.append(url)
        expected = shard.stop if shard.stop is not None else size
        if expected is not None and found != expected:
            pending.mismatched[url] = [found, -1 if size is None else size]

    def _check_listed(self, raw: RawSample, shard: _OpenShard, pending: _Pending) -> None:
        """A shard with more samples than sizes.json lists: the plan never reads past that count, so
        the rest would go unread in silence; seen as soon as a sample follows the last listed one."""
        size = self.size(shard.shard)
        if shard.stop is None and size is not None and raw.followed and raw.index + 1 >= size:
            pending.mismatched[self.url(shard.shard)] = [MORE_THAN_LISTED, size]

    def _add(self, raw: RawSample, shard: _OpenShard, pending: _Pending) -> bool:
        """Decode, transform and append one sample; False when it is skipped as corrupt."""
        decoded = decode_sample(raw, load=False, keys=self.stream.keys)
        pixels = None if isinstance(decoded, str) else self._pixels(decoded.image, shard.shard, raw.index)
        if pixels is None:
            reason = decoded if isinstance(decoded, str) else BAD_IMAGE
            pending.skipped[reason] += 1
            self._log_skip(reason, raw, self.url(shard.shard))
            return False
        shard.valid, shard.fruitful = raw.after, True
        slot = len(pending.keys)
        pending.images.numpy()[slot] = pixels  # the one copy: PIL's pixels into the shared batch
        if self.erase:
            self._erase_boxes(pending.erase[slot], shard.shard, raw.index)
        self.emitted += 1
        pending.captions.append(decoded.caption)
        pending.keys.append(raw.key)
        pending.shards.append(shard.shard)
        pending.after.append(
            [*raw.after.to_json(), shard.first, NO_STOP if shard.stop is None else shard.stop]
        )
        pending.states.append(
            encode_row(self.draws, self.tasks, self.emitted, self.fruitless, self.open, width=self.width)
        )
        return True

    def _pixels(self, image: Any, shard: int, index: int) -> Any:
        """The transformed uint8 pixels, or None when the image turns out damaged while decoding."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return self.stream.transform(image, self._crop_rng(shard, index))
        except Exception:  # PIL raises many types on damaged data (OSError, ValueError, SyntaxError...)
            return None

    def _erase_boxes(self, row: torch.Tensor, shard: int, index: int) -> None:
        rng = self._crop_rng(shard, index, purpose="erase")
        boxes = erase_boxes(self.stream.transform.image_size, self.stream.transform.aug, rng)
        seed = rng.getrandbits(62)
        for k, box in enumerate(boxes):
            row[k] = torch.tensor([*box, seed])
        row[:, 4] = seed

    def _crop_rng(self, task: int, index: int, *, purpose: str = "") -> random.Random:
        """Keyed by (seed, epoch, shard or draw, sample index): the same at every world size."""
        # A plain crop keeps its key, so older checkpoints resume on the same crops.
        extra = (purpose,) if purpose else ()
        return keyed_rng(self.job.crop_key, task, index, *extra)

    def _log_skip(self, reason: str, raw: RawSample, url: str) -> None:
        self.logged_skips += 1
        if self.logged_skips <= LOGGED_SKIPS_PER_WORKER:
            log.warning("skipping sample %r of %s: %s", raw.key, url, reason)

    def _emit(self, pending: _Pending, *, last: bool) -> dict[str, Any]:
        n = len(pending.keys)
        return {
            "generation": self.job.generation,  # the consumer checks it is the epoch it is on
            "worker": self.spec.worker,
            "last": last,
            "images": pending.images[:n],
            "erase": pending.erase[:n],
            "texts": self.stream.tokenizer(pending.captions) if n else torch.empty(0, dtype=torch.long),
            "keys": pending.keys,
            "shards": torch.tensor(pending.shards, dtype=torch.long),
            "after": torch.tensor(pending.after, dtype=torch.long).reshape(-1, 4),  # index, byte, first, stop
            "states": torch.tensor(pending.states, dtype=torch.long).reshape(-1, self.width),
            "ends": pending.ends,
            "skipped": dict(pending.skipped),
            "broken": pending.broken,
            "empty": pending.empty,
            "mismatched": pending.mismatched,
            "busy_s": time.perf_counter() - pending.started,
        }
