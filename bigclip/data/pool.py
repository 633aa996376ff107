"""A rank's data workers, started once for the whole run: every epoch runs on the same processes.

Forking the workers anew each epoch made every worker build its S3 client again (a credential
look-up each: at 1024 ranks x 8-12 workers, thousands per epoch against a metadata service that
throttles) and tore down s3torchconnector's clients at each fork. So the pool wraps one torch
DataLoader with `persistent_workers` over one `ReaderStream`: the workers are forked when the
first epoch starts, keep their storage clients, and take each epoch's readers from the job board
(jobs.py). `start(jobs)` posts them and restarts the DataLoader's iteration; torch then hands
every worker a "resume" message and discards, before the epoch's first batch, whatever the
previous epoch's readers had prefetched (at most `prefetch_factor` batches a worker), and the
stream's next `iter` in each worker takes the new job. With --workers 0 the reader runs in the
training process, as before.

At an epoch's end the pool idles (`idle()`): the same reset with empty jobs, so the batches
prefetched past the end and the open shards are let go before evaluation and checkpoints, not
held until the next epoch. A pool is closed by whoever made it: `TrainData` (train_data.py) for a run, or a `TrainLoader`
built on its own, at the end of its one epoch.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from bigclip.config import DataConfig
from bigclip.data.augment import Augmentation
from bigclip.data.decode import SampleKeys
from bigclip.data.jobs import JobBoard, ReaderJob
from bigclip.data.shards import ShardList
from bigclip.data.tokenizer import Tokenizer
from bigclip.data.transforms import train_transform
from bigclip.data.worker import ReaderStream
from bigclip.data.worker_signals import shield_worker

FORK_SETTLE_S = 0.05  # see settle_before_fork


class ReaderPool:
    def __init__(self, stream: ReaderStream, *, workers: int, pin_memory: bool = False) -> None:
        self.stream, self.workers = stream, workers
        # Fork on Linux even when this process was itself started by multiprocessing 'spawn'
        # (bigclip.distributed.spawn), which would otherwise be inherited and make every worker
        # re-import torch. Workers never touch CUDA, so fork is safe.
        fork = sys.platform.startswith("linux") and workers > 0
        self.context = multiprocessing.get_context("fork" if fork else None)
        self.board = stream.board = JobBoard(workers, self.context)
        self.generation = 0  # epochs started on these workers
        self.closed = False
        self.loader = DataLoader(
            stream,
            batch_size=None,
            num_workers=workers,
            pin_memory=pin_memory,
            multiprocessing_context=self.context if workers else None,
            persistent_workers=workers > 0,
            # The workers' randomness is keyed by position (randomness.py), so their base seed is
            # unused; drawing it from a private generator leaves the training process's RNG
            # (patch dropout) untouched, which exact resume relies on.
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=shield_worker,  # preemption signals are the rank's to handle
        )

    @classmethod
    def for_config(
        cls,
        cfg: DataConfig,
        shards: ShardList,
        *,
        image_size: int,
        tokenizer: Tokenizer,
        pin_memory: bool = False,
    ) -> ReaderPool:
        """The pool for training on `shards` with these settings (what stays the same all run)."""
        stream = ReaderStream(
            urls=shards.urls,
            resampled=cfg.dataset_resampled,
            batch_size=cfg.batch_size,
            interleave=cfg.shard_interleave,
            transform=train_transform(
                image_size, aug=Augmentation.from_cfg(cfg.aug_cfg), fast=cfg.train_transform == "fast"
            ),
            tokenizer=tokenizer,
            cumulative=shards.cumulative_weights(),
            keys=SampleKeys.parse(image_key=cfg.image_key, text_key=cfg.text_key),
            sizes=shards.sizes,
        )
        return cls(stream, workers=cfg.workers, pin_memory=pin_memory)

    @property
    def started(self) -> bool:
        """Whether the worker processes exist (they are forked when the first epoch starts)."""
        return self.loader._iterator is not None  # torch keeps persistent workers' iterator there

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids (none before the first epoch starts, nor with --workers 0)."""
        iterator = self.loader._iterator
        return [w.pid for w in iterator._workers] if iterator is not None else []

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation

    def start(self, jobs: list[ReaderJob]) -> Iterator[dict[str, Any]]:
        """Hand the workers an epoch's jobs (the i-th to worker i); the iterator of their batches."""
        if self.closed:
            raise RuntimeError("the data workers were closed; build a new loader")
        if {job.generation for job in jobs} != {self.generation}:
            raise ValueError(
                f"jobs of generations {sorted({j.generation for j in jobs})}, not {self.generation}"
            )
        self.board.post(jobs)
        if self.workers and not self.started:
            settle_before_fork()
        return iter(self.loader)

    def idle(self, generation: int) -> None:
        """Between epochs: the workers drop what they hold of epoch start `generation` (batches
        prefetched past its end, open shards) instead of keeping it until the next one starts.
        Nothing happens if another epoch has started on them since (a loader's late clean-up)."""
        if not self.workers or not self.started or self.closed or generation != self.generation:
            return
        generation = self.next_generation()
        self.board.post([ReaderJob(generation, None, "", "") for _ in range(self.workers)])
        iter(self.loader)  # torch's reset: stale batches discarded, each stream restarted on an empty job

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self.closed:
            return
        self.closed = True
        iterator, self.loader._iterator = self.loader._iterator, None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.board.close()


def settle_before_fork() -> None:
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
    if dist.is_initialized() and sys.version_info < (3, 11, 10):
        time.sleep(FORK_SETTLE_S)
