"""The per-rank training loader: batches for the training loop, and an exact, resumable position.

    data = TrainData(cfg.data, rank=r, world_size=n, seed=s, image_size=224, tokenizer=tok,
                     device=d, image_dtype=torch.bfloat16)     # train_data.py: once per run
    loader = data.epoch(e, position=saved_or_None)   # or build_train_loader(..., epoch=e) on its own
    for batch in loader:            # TrainBatch: images [B,3,H,W] normalised on d, texts [B,L], keys
        ...
        mine = loader.rank_state()   # this rank's own state for a checkpoint: no collective

Workers: a loader of a `TrainData` runs on the run's data workers, started at the first epoch
and kept (pool.py): it hands each worker its reader for the epoch (jobs.py) when iteration
starts, and at the epoch's end lets them idle. A loader built on its own (`build_train_loader`)
starts its own workers and stops them at its epoch's end. On an object store, the readers' first
shard opens are spread over the epoch's first seconds (open_schedule.py; `open_rate`).

Images arrive from the workers as uint8 and are normalised on `device` in `image_dtype`
(device.py); `loader.stats.take_capacity()` says how many samples/s the workers could have
delivered (their busy time, not counting waits for the training loop).

Where consumption is tracked: here, in the main process, when a batch is handed to the
training loop. Workers prefetch, so what they have read says nothing about what was used.

How an epoch ends: when the epoch's sample budget (`--train-num-samples`, else the sizes.json
total) has no room for another global batch: the planned steps. With sizes.json covering
every shard, the plan (resume/assignment.py) gives every rank the same number of samples,
splitting shards where needed, so every rank fills exactly the planned steps and the epoch
reads every sample once, less a remainder smaller than one global batch. As a guard, every
step the ranks all-reduce (MIN, on a CPU gloo group, so no GPU sync) one "I have a full
batch" flag, and the epoch ends for everyone at the first step some rank cannot fill: without
sizes (whole shards dealt by estimate), or when corrupt samples, damaged shards or a stale
sizes.json took samples away. `account_epoch()` then logs, on rank 0, one line with the
samples and steps read against the plan, the ranks that ran out and every loss counted by
kind (accounting.py); `state_dict()` still lists what was not read as unconsumed.

Saving and resuming the data position (the contract with the checkpoint; resume/rank_state.py):
  save    every rank saves `loader.rank_state()`: its own state, JSON-able, no collective, O(1) in
          world size (its readers' states and plans, what is left of its pieces, the epoch's
          samples; a few KB, fewer as the world grows).
  resume  at the same settings (world size, --workers, --batch-size, --shard-interleave, --seed,
          shards; `continues_alone(state, world_size=, workers=, batch_size=, interleave=, seed=)`,
          all-reduced so every rank agrees): every rank reads only its own state and passes it as
          `position=`; the stream continues exactly, every rank getting the batches, samples and
          crops an uninterrupted run would have had (stream_state.py).
          Otherwise one process reads every rank's state and `merge_rank_states(states)` turns them
          into the global, world-size-free position (position.py: O(shards), to broadcast), which
          `position=` takes at any world size and worker count: the unfinished shards are
          re-planned over this run's readers and continue at their cursors, so no sample of the
          epoch is seen twice or skipped, and a log line says why the order changed.
  before  `position=` still takes the global position checkpoints held before rank states
          (`state_dict()`: collective, every rank's progress gathered and merged), with its stream
          state: at the same settings that stream continues exactly too.
With --dataset-resampled the same holds for the epoch's global sequence of shard draws
(position.py): N -> M ranks, no draw is read twice or skipped, and crops stay keyed by (draw, sample).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from bigclip.config import DataConfig
from bigclip.data.accounting import DataStats, EpochAccount, combine, no_batch_error, report
from bigclip.data.batching import Chunk, Rebatcher, WorkerOrder
from bigclip.data.device import image_normalizer
from bigclip.data.jobs import ReaderJob, ReaderSpec, epoch_jobs, reader_specs
from bigclip.data.open_schedule import OPEN_RATE, open_delays
from bigclip.data.pool import ReaderPool
from bigclip.data.resume.assignment import assign_readers
from bigclip.data.resume.position import DataPosition, RankProgress
from bigclip.data.resume.rank_state import RankState, is_rank_state, merge_rank_states, own_assignment
from bigclip.data.resume.reader_state import ReaderState
from bigclip.data.resume.stream_state import RankStream, StreamSettings, StreamState
from bigclip.data.shards import ShardList
from bigclip.data.tar_samples import Cursor
from bigclip.data.tokenizer import Tokenizer
from bigclip.data.validation import epoch_samples, validate_data
from bigclip.distributed import cpu_group
from bigclip.storage.schemes import is_local


@dataclass
class TrainBatch:
    images: torch.Tensor  # [B, 3, H, W] normalised, in image_dtype on the device (uint8 [B, H, W, 3] if not)
    texts: torch.Tensor  # long [B, context_length]
    keys: list[str]  # the samples' webdataset keys


class TrainLoader:
    """One rank's loader for one epoch (or the rest of one). Iterate it once; the next epoch is
    another TrainLoader, on the same workers when both come from one `TrainData` (train_data.py)."""

    def __init__(
        self,
        cfg: DataConfig,
        *,
        rank: int,
        world_size: int,
        seed: int,
        epoch: int,
        image_size: int,
        tokenizer: Tokenizer,
        position: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        image_dtype: torch.dtype = torch.float32,
        normalize: bool = True,
        shards: ShardList | None = None,
        pool: ReaderPool | None = None,
        open_rate: float | None = OPEN_RATE,
    ) -> None:
        self.cfg, self.rank, self.world_size, self.seed = cfg, rank, world_size, seed
        self.shards = shards or validate_data(cfg, world_size=world_size)
        self.num_samples = epoch_samples(cfg, self.shards)
        self.global_batch = cfg.batch_size * world_size
        self.steps_per_epoch = self.num_samples // self.global_batch
        self._specs = self._begin(position, epoch)
        self.device = torch.device(device) if device is not None else None
        self.normalizer = (
            image_normalizer(cfg, device=self.device or "cpu", dtype=image_dtype) if normalize else None
        )
        self.group = cpu_group()
        if world_size > 1 and self.group is None:
            raise RuntimeError(
                "world_size > 1 needs torch.distributed initialised before building the loader"
            )
        if self.group is not None and dist.get_world_size(self.group) != world_size:
            raise ValueError(
                f"world_size={world_size} but the default process group has {dist.get_world_size()}"
            )
        self.progress = RankProgress()
        self.stats = DataStats(readers=max(1, cfg.workers))
        self.steps = 0  # steps taken by this loader (the same on every rank)
        # A remote store has a request rate to respect; a local disk does not (open_schedule.py).
        self.open_rate = None if all(is_local(u) for u in self.shards.urls) else open_rate
        self._owns_pool = pool is None  # built on its own: its workers stop with its epoch
        pin = self.device is not None and self.device.type == "cuda"
        self.pool = pool or ReaderPool.for_config(
            cfg, self.shards, image_size=image_size, tokenizer=tokenizer, pin_memory=pin
        )
        self._iterated = False
        self._batches: Generator[TrainBatch, None, None] | None = None
        self._order: WorkerOrder | None = None
        self._rebatcher: Rebatcher | None = None
        self._stream_ended = False  # the epoch ended because some rank ran out of data
        self._ran_dry = False  # ...this one among them

    def _begin(self, position: dict[str, Any] | None, epoch: int) -> list[ReaderSpec]:
        """Where this epoch starts, and this rank's readers for it: a fresh plan, a global position
        (re-planned, or its saved stream continued), or this rank's own saved state (continued)."""
        cfg, resampled = self.cfg, self.cfg.dataset_resampled
        self.settings = StreamSettings(
            self.world_size, cfg.workers, cfg.batch_size, cfg.shard_interleave, self.seed
        )
        self._saved = RankState.from_json(position) if is_rank_state(position) else None
        if self._saved is not None:
            self.start = self._saved.start()
        elif position is not None:
            self.start = DataPosition.from_json(position)
        else:
            self.start = DataPosition.start_of(epoch, self.shards, resampled=resampled)
        self.start.check_compatible(self.shards, epoch=epoch, resampled=resampled)
        if self._saved is not None:
            assignment = own_assignment(self._saved, self.shards, self.settings, rank=self.rank)
        else:
            assignment = assign_readers(self.shards, self.start, self.settings, rank=self.rank)
        # Right at least on this rank's pieces: what rank_state() advances by this loader's progress.
        self.base = self._saved.local() if self._saved is not None else self.start
        self.origin, self.initial, self.plans = assignment.origin, assignment.stream, assignment.tasks
        # Per worker, the reader's state after the last sample consumed from it (as a row of ints).
        self.reader_rows = [r.to_ints() for r in assignment.stream.readers]
        return reader_specs(assignment, seed=self.seed, epoch=self.start.epoch, rank=self.rank)

    def _jobs(self) -> list[ReaderJob]:
        """The epoch's job for each worker, handed out when iteration starts (jobs.py)."""
        slots, now = max(1, self.cfg.workers), time.monotonic()
        delays = open_delays(rank=self.rank, world_size=self.world_size, readers=slots,
                             interleave=self.cfg.shard_interleave, rate=self.open_rate)  # fmt: skip
        return epoch_jobs(self._specs, generation=self.pool.next_generation(), seed=self.seed,
                          epoch=self.start.epoch, open_at=[now + d for d in delays])  # fmt: skip

    @property
    def samples_consumed(self) -> int:
        """Samples of this epoch consumed by all ranks together, including before a resume."""
        return self.start.samples + self.steps * self.global_batch

    @property
    def steps_remaining(self) -> int:
        """Planned steps left in the epoch (the data may run out a little earlier; see the module doc)."""
        return max(0, (self.num_samples - self.samples_consumed) // self.global_batch)

    def __len__(self) -> int:
        return self.steps_remaining

    def __iter__(self) -> Iterator[TrainBatch]:
        if self._iterated:
            raise RuntimeError("a TrainLoader is iterated once; build a new one for the next epoch")
        self._iterated = True
        self._batches = self._generate()
        return self._batches

    def close(self) -> None:
        """End this epoch's iteration now (e.g. after leaving the loop early at --max-steps); a loader
        built on its own (no `pool`) also stops its worker processes."""
        if self._batches is not None:
            self._batches.close()
        if self._owns_pool:
            self.pool.close()

    def _generate(self) -> Iterator[TrainBatch]:
        started_empty = self.start.samples == 0
        jobs = self._jobs()
        source = self.pool.start(jobs)
        order = self._order = WorkerOrder(source, active=self.initial.active, generation=jobs[0].generation)
        rebatcher = self._rebatcher = Rebatcher(self.cfg.batch_size, on_chunk=self._learn)
        failed = True
        try:
            for worker in self.initial.carry:  # resumed: the unconsumed tails of last batches, oldest first
                rebatcher.refill(order.next_from(worker))
            while self.steps_remaining > 0:
                chunk = rebatcher.next_batch(order)
                self._ran_dry = chunk is None
                if not self._all_ranks_have(chunk is not None):
                    # Some rank ran dry: batches fetched here stay unconsumed, so the stream state no
                    # longer describes a stream to continue (the position still counts them unconsumed).
                    self._stream_ended = True
                    break
                try:
                    yield self._consume(chunk)
                except GeneratorExit:  # close(): the epoch ends here, as planned by the caller
                    failed = False
                    raise
            failed = False
        finally:
            order.close()
            del source
            if self._owns_pool:
                self.pool.close()
            elif not failed:  # (after a failure the workers may be gone: the error must surface)
                self.pool.idle(jobs[0].generation)
        if self.steps == 0 and started_empty:
            raise no_batch_error(self.stats, epoch=self.start.epoch, batch_size=self.cfg.batch_size,
                                 pattern=self.cfg.train_data, rank=self.rank)  # fmt: skip

    def _all_ranks_have(self, has_batch: bool) -> bool:
        if self.group is None:
            return has_batch
        flag = torch.tensor([int(has_batch)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _learn(self, worker_batch: dict[str, Any]) -> None:
        """Bookkeeping that arrives with a worker batch, whether or not its samples are consumed yet."""
        for shard, first, stop, index, byte in worker_batch["ends"]:
            self.progress.ends[(shard, first, stop)] = Cursor(index, byte)
        self.stats.learn(worker_batch)

    def _consume(self, chunk: Chunk) -> TrainBatch:
        for shard, (index, byte, first, stop) in zip(chunk.shards.tolist(), chunk.after.tolist()):
            self.progress.consume((shard, first, stop), Cursor(index, byte))
        for worker, row in zip(chunk.workers.tolist(), chunk.states.tolist()):
            self.reader_rows[worker] = row
        self.steps += 1
        self.stats.samples += len(chunk.keys)
        images, texts = chunk.images, chunk.texts
        if self.device is not None and self.device.type == "cuda" and not images.is_pinned():
            images, texts = images.pin_memory(), texts.pin_memory()  # joined from short batches
        if self.normalizer is not None:
            images = self.normalizer(images, chunk.erase)
        if self.device is not None:
            texts = texts.to(self.device, non_blocking=True)
        return TrainBatch(images=images, texts=texts, keys=chunk.keys)

    def account_epoch(self) -> EpochAccount:
        """Collective, at the epoch's end: what it read against the plan, and what it lost and why;
        rank 0 logs it as one line (a warning when anything was lost)."""
        account = EpochAccount(
            epoch=self.start.epoch,
            samples=self.samples_consumed,
            steps=self.samples_consumed // self.global_batch,
            planned_steps=self.steps_per_epoch,
            global_batch=self.global_batch,
            listed=self.shards.total_samples if not self.start.resampled else None,
            resampled=self.start.resampled,
        )
        mine = self.stats.rank_counts(ran_dry=self._ran_dry)
        account = combine(account, self._gather(mine))
        report(account, rank=self.rank)
        return account

    def rank_state(self) -> dict[str, Any]:
        """This rank's own state for a checkpoint (resume/rank_state.py): no collective, JSON-able,
        O(1) in world size. A loader at the same settings continues from it alone (continues_alone);
        at others, resume from merge_rank_states(every rank's)."""
        stream = None if self._stream_ended else self._rank_stream()
        return RankState.build(
            rank=self.rank, settings=self.settings, now=self.base.merge([self.progress]),
            samples=self.samples_consumed, origin=self.origin, plans=self.plans,
            readers=[ReaderState.from_ints(row) for row in self.reader_rows], stream=stream,
        ).to_json()  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The epoch's position, merged over all ranks (collective: call it on every rank). JSON-able."""
        if self._saved is not None:  # started from a rank's own state: no global position to advance
            return merge_rank_states(self._gather(self.rank_state()))
        self.progress.stream = None if self._stream_ended else self._rank_stream()
        gathered = self._gather(self.progress)
        merged = self.start.merge(gathered)
        if all(p.stream is not None for p in gathered):
            ranks = [p.stream for p in gathered]
            merged.stream = StreamState(self.settings, self.origin.to_json(), ranks)
        return merged.to_json()

    def _gather(self, mine: Any) -> list[Any]:
        if self.group is None:
            return [mine]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        return gathered

    def _rank_stream(self) -> RankStream:
        """Where this rank's stream stands: readers after their last consumed sample, order, carry."""
        readers = [ReaderState.from_ints(row) for row in self.reader_rows]
        if self._order is None:  # not iterated yet
            return RankStream(readers, list(self.initial.active), list(self.initial.carry))
        return RankStream(readers, list(self._order.active), self._rebatcher.carry_workers())


# The public name the trainer and tools build loaders by (the class validates the shards first,
# a DataError in seconds, unless `shards` is given).
build_train_loader = TrainLoader
