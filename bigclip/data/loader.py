"""The per-rank training loader: batches for the training loop, and an exact, resumable position.

    loader = build_train_loader(cfg.data, rank=r, world_size=n, seed=s, epoch=e,
                                image_size=224, tokenizer=tok, position=saved_or_None,
                                device=d, image_dtype=torch.bfloat16)
    for batch in loader:            # TrainBatch: images [B,3,H,W] normalised on d, texts [B,L], keys
        ...
        state = loader.state_dict()  # collective: every rank calls it; JSON-able, world-size free

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

Resume: `position=` takes a `state_dict()` from any world size and worker count. At the same
settings (world size, --workers, --batch-size, --shard-interleave, --seed, shards) the stream
continues exactly: every rank gets the batches, samples and crops an uninterrupted run would
have had (stream_state.py). Otherwise the unfinished shards are re-planned over this run's
readers and continue at their cursors, so no sample of the epoch is seen twice or skipped,
and a log line says why the order changed. With --dataset-resampled the same holds for the
epoch's global sequence of shard draws (position.py): N -> M ranks, no draw is read twice or
skipped, and crops stay keyed by (draw, sample).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from bigclip.config import DataConfig
from bigclip.data.accounting import DataStats, EpochAccount, combine, gather_counts, no_batch_error, report
from bigclip.data.augment import Augmentation
from bigclip.data.batching import Chunk, Rebatcher, WorkerOrder
from bigclip.data.decode import SampleKeys
from bigclip.data.device import image_normalizer
from bigclip.data.resume.assignment import ReaderAssignment, assign_readers
from bigclip.data.resume.position import DataPosition, RankProgress
from bigclip.data.resume.randomness import draws_key, stream_key
from bigclip.data.resume.reader_state import ReaderState
from bigclip.data.resume.stream_state import RankStream, StreamSettings, StreamState
from bigclip.data.shards import ShardList
from bigclip.data.tar_samples import Cursor
from bigclip.data.tokenizer import Tokenizer
from bigclip.data.transforms import train_transform
from bigclip.data.validation import epoch_samples, validate_data
from bigclip.data.worker import ReaderSpec, ReaderStream
from bigclip.data.worker_signals import shield_worker
from bigclip.distributed import cpu_group

FORK_SETTLE_S = 0.05  # see _settle_before_fork


@dataclass
class TrainBatch:
    images: torch.Tensor  # [B, 3, H, W] normalised, in image_dtype on the device (uint8 [B, H, W, 3] if not)
    texts: torch.Tensor  # long [B, context_length]
    keys: list[str]  # the samples' webdataset keys


class TrainLoader:
    """One rank's loader for one epoch (or the rest of one). Iterate it once; build a new one per epoch."""

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
    ) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.shards = shards or validate_data(cfg, world_size=world_size)
        self.num_samples = epoch_samples(cfg, self.shards)
        self.global_batch = cfg.batch_size * world_size
        self.steps_per_epoch = self.num_samples // self.global_batch
        self.start = self._start_position(position, epoch)
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
        self._dataset = self._reader_stream(seed=seed, image_size=image_size, tokenizer=tokenizer)
        self._iterated = False
        self._batches: Generator[TrainBatch, None, None] | None = None
        self._order: WorkerOrder | None = None
        self._rebatcher: Rebatcher | None = None
        self._stream_ended = False  # the epoch ended because some rank ran out of data
        self._ran_dry = False  # ...this one among them

    def _start_position(self, position: dict[str, Any] | None, epoch: int) -> DataPosition:
        resampled = self.cfg.dataset_resampled
        if position is None:
            return DataPosition.start_of(epoch, self.shards, resampled=resampled)
        start = DataPosition.from_json(position)
        start.check_compatible(self.shards, epoch=epoch, resampled=resampled)
        return start

    def _reader_stream(self, *, seed: int, image_size: int, tokenizer: Tokenizer) -> ReaderStream:
        cfg, epoch = self.cfg, self.start.epoch
        self.settings = StreamSettings(
            self.world_size, cfg.workers, cfg.batch_size, cfg.shard_interleave, seed
        )
        assignment = assign_readers(self.shards, self.start, self.settings, rank=self.rank)
        self.origin, self.initial = assignment.origin, assignment.stream
        self.exact_resume = assignment.exact  # continues a saved stream exactly (same settings)
        # Per worker, the reader's state after the last sample consumed from it (as a row of ints).
        self.reader_rows = [r.to_ints() for r in assignment.stream.readers]
        return ReaderStream(
            readers=self._reader_specs(assignment, seed=seed),
            urls=self.shards.urls,
            resampled=self.start.resampled,
            batch_size=cfg.batch_size,
            interleave=cfg.shard_interleave,
            transform=train_transform(
                image_size, aug=Augmentation.from_cfg(cfg.aug_cfg), fast=cfg.train_transform == "fast"
            ),
            tokenizer=tokenizer,
            crop_key=f"bigclip-crop/{seed}/{epoch}",
            draws_key=draws_key(seed=seed, epoch=epoch),
            cumulative=self.shards.cumulative_weights(),
            keys=SampleKeys.parse(image_key=cfg.image_key, text_key=cfg.text_key),
            sizes=self.shards.sizes,
        )

    def _reader_specs(self, assignment: ReaderAssignment, *, seed: int) -> list[ReaderSpec]:
        """Data worker i runs the i-th: the carry's readers first, then the round robin from its next
        worker, so that the DataLoader's own round robin already delivers batches in stream order."""
        epoch, origin = self.start.epoch, self.origin.samples
        return [
            ReaderSpec(
                worker=w,
                key=stream_key(seed=seed, epoch=epoch, origin=origin, rank=self.rank, worker=w),
                plan=assignment.tasks[w],
                state=assignment.stream.readers[w],
                tail=assignment.tails[w],
            )
            for w in assignment.stream.carry + assignment.stream.active
        ]

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
        """Stop the worker processes now (e.g. after leaving the loop early at --max-steps)."""
        if self._batches is not None:
            self._batches.close()

    def _generate(self) -> Iterator[TrainBatch]:
        started_empty = self.start.samples == 0
        self._settle_before_fork()
        source = iter(self._dataloader())
        order = self._order = WorkerOrder(source, active=self.initial.active)
        rebatcher = self._rebatcher = Rebatcher(self.cfg.batch_size, on_chunk=self._learn)
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
                yield self._consume(chunk)
        finally:
            order.close()  # drops the DataLoader iterator: shuts the worker processes down
            del source
        if self.steps == 0 and started_empty:
            self._raise_no_batch()

    def _dataloader(self) -> DataLoader:
        pin = self.device is not None and self.device.type == "cuda"
        # Fork on Linux even when this process was itself started by multiprocessing 'spawn'
        # (bigclip.distributed.spawn), which would otherwise be inherited and make every worker
        # re-import torch: seconds per worker per epoch. Workers never touch CUDA, so fork is safe.
        context = "fork" if sys.platform.startswith("linux") and self.cfg.workers > 0 else None
        return DataLoader(
            self._dataset,
            batch_size=None,
            num_workers=self.cfg.workers,
            pin_memory=pin,
            multiprocessing_context=context,
            # The workers' randomness is keyed by position (randomness.py), so their base seed is
            # unused; drawing it from a private generator leaves the training process's RNG
            # (patch dropout) untouched, which exact resume relies on.
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=shield_worker,  # preemption signals are the rank's to handle
        )

    def _settle_before_fork(self) -> None:
        """Give torch.distributed's threads time to finish with Python before the workers are forked.

        CPython before 3.11.10 can leave a forked child deadlocked for good if another thread
        is creating a Python thread state at the moment of fork (CPython gh-112275): a hung
        data worker, a hung run. gloo's worker threads do just that right after a collective
        completes (they take the GIL to release its tensors), and a loader is typically built
        right after one (validate_data's broadcast, the last step's all-reduce, a checkpoint).
        Sleeping releases the GIL, so they finish first. Seen here (Python 3.11.7, 2 ranks): of
        loaders built right after a broadcast, about one in 500 hung without this, none of
        1,500 with it.
        """
        if self.cfg.workers > 0 and dist.is_initialized() and sys.version_info < (3, 11, 10):
            time.sleep(FORK_SETTLE_S)

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

    def _raise_no_batch(self) -> None:
        raise no_batch_error(self.stats, epoch=self.start.epoch, batch_size=self.cfg.batch_size,
                             pattern=self.cfg.train_data, rank=self.rank)  # fmt: skip

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
        )
        mine = self.stats.rank_counts(ran_dry=self._ran_dry)
        account = combine(account, gather_counts(mine, self.group, self.world_size))
        report(account, rank=self.rank)
        return account

    def state_dict(self) -> dict[str, Any]:
        """The epoch's position, merged over all ranks (collective: call it on every rank). JSON-able."""
        self.progress.stream = None if self._stream_ended else self._rank_stream()
        if self.group is None:
            gathered = [self.progress]
        else:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, self.progress, group=self.group)
        merged = self.start.merge(gathered)
        if all(p.stream is not None for p in gathered):
            ranks = [p.stream for p in gathered]
            merged.stream = StreamState(self.settings, self.origin.to_json(), ranks)
        return merged.to_json()

    def _rank_stream(self) -> RankStream:
        """Where this rank's stream stands: readers after their last consumed sample, order, carry."""
        readers = [ReaderState.from_ints(row) for row in self.reader_rows]
        if self._order is None:  # not iterated yet
            return RankStream(readers, list(self.initial.active), list(self.initial.carry))
        return RankStream(readers, list(self._order.active), self._rebatcher.carry_workers())


# The public name the trainer and tools build loaders by (the class validates the shards first,
# a DataError in seconds, unless `shards` is given).
build_train_loader = TrainLoader
