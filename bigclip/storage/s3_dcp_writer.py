"""The DCP writer of checkpoints on S3, shaped for S3's request rates at 1024 ranks.

S3 admits about 3,500 writes a second per partitioned prefix and answers 503 SlowDown beyond
(it splits a busy prefix's keys over partitions as the load persists). A save is every rank
writing at once, so:

- **prefixes**: each rank writes under a sub-folder of its own, `step_N/<hex>/__R_0.distcp`
  (s3torchconnector's `HexPrefixStrategy`, one prefix per rank, its fastest-changing digit
  first, so S3 can split the keys right after `step_N/`). DCP records each object's path
  relative to the checkpoint folder in `.metadata`, so stock DCP with s3torchconnector's reader
  reads it; `prefix_strategy(rank)` tells any planner where rank R writes.
- **few requests per rank**: every upload is multipart (2 + parts requests); one object per rank
  unless the rank's shard is large, parts of 64 MiB (save_requests.py); no rank asks whether
  `.metadata` exists (DCP's writer sends every rank's HEAD to the one `step_N/` prefix only to
  warn about an overwrite; the store empties the folder before each save).
- **start jitter**: a rank waits a random moment, at most a tenth of its expected upload time
  (`start_delay`), so a thousand ranks do not send their first request in the same millisecond.
- **backoff beyond the client's**: the CRT client tries each request `max_attempts` times
  (AWS_MAX_ATTEMPTS, default 10), backing off from 500 ms with full jitter, each wait capped at
  20 s. An object that still fails with throttling is written again from its start, up to
  REWRITES times, after an exponential backoff with full jitter (`rewrite_delay`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from s3torchconnector.dcp import S3StorageWriter
from s3torchconnector.dcp.s3_file_system import StorageMetadata
from s3torchconnector.dcp.s3_prefix_strategy import HexPrefixStrategy
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from bigclip.storage.rank_prefixes import HEX, HEX_DIGITS
from bigclip.storage.save_requests import files_for

log = logging.getLogger("bigclip.storage")

RANK_BYTES_PER_S = 0.5e9 / 8  # the planner's per-node checkpoint rate, shared by 8 GPUs
JITTER_FRACTION = 0.1  # of the rank's expected upload time
JITTER_CAP_S = 2.0
REWRITES = 3
REWRITE_BASE_S = 0.5
REWRITE_CAP_S = 30.0
_THROTTLED = ("throttl", "slowdown", "slow down")  # the CRT's "Request throttled", S3's "SlowDown"
# Its own generator: the training process seeds Python's `random` for reproducible runs, and
# uploads run in a background thread during async saves; neither may disturb the other.
_RNG = random.Random()


def start_delay(nbytes: int, *, rng: random.Random = _RNG) -> float:
    """Seconds a rank waits before its first request: uniform up to a tenth of its expected upload."""
    return rng.uniform(0.0, min(JITTER_CAP_S, JITTER_FRACTION * nbytes / RANK_BYTES_PER_S))


def rewrite_delay(attempt: int, *, rng: random.Random = _RNG) -> float:
    """Full-jitter exponential backoff before rewrite number `attempt` + 1 (0-based)."""
    return rng.uniform(0.0, min(REWRITE_CAP_S, REWRITE_BASE_S * 2**attempt))


def is_throttled(error: BaseException) -> bool:
    text = str(error).lower()
    return any(word in text for word in _THROTTLED)


def item_bytes(item: WriteItem) -> int:
    """Bytes of a rank's slice of a tensor (pickled values count as none: they are small)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items in `bins` groups of about equal bytes (as DCP splits them among its threads), no empty one."""
    groups: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    values = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(values):
        groups[n % bins].append(item)
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=item_bytes, reverse=True):
        smallest = sizes.index(min(sizes))
        groups[smallest].append(item)
        sizes[smallest] += item_bytes(item)
    return [g for g in groups if g] or [[]]


class S3CheckpointWriter(S3StorageWriter):
    """s3torchconnector's DCP writer with rank prefixes, few objects, jitter and rewrites (module docstring)."""

    prefix_rule = HEX  # recorded in the manifest: readers find rank R's objects by it

    def __init__(self, region: str, path: str, *, world_size: int, files: int | None = None) -> None:
        """`files`: objects per rank (None: `files_for` the rank's bytes)."""
        # HEX_DIGITS hex digits per rank prefix: distinct up to 65,536 ranks (rank_prefixes.py
        # computes the same names for readers).
        strategy = HexPrefixStrategy(min_prefix_length=HEX_DIGITS, prefix_count=max(1, world_size))
        # One thread per object, each writing its object alone (`_write_file`): DCP's own helper
        # threads die with their errors unraised and are not joined when the first thread fails.
        super().__init__(region, path, prefix_strategy=strategy, thread_count=1)
        self.files = files

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """DCP's, less its HEAD of `.metadata` (see the module docstring). Without collectives
        (rank-local metadata) each rank names its own prefix, as DCP's names `__R_`."""
        rank, collective = getattr(self, "rank", None), getattr(self, "use_collectives", True)
        if rank is not None and not collective:
            return dataclasses.replace(plan, storage_data=StorageMetadata(self.prefix_strategy(rank)))
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        nbytes = sum(item_bytes(i) for i in plan.items)
        groups = split_items(plan.items, self.files or files_for(nbytes))
        time.sleep(start_delay(nbytes))
        names = [f"{plan.storage_data.prefix}{n}{DEFAULT_SUFFIX}" for n in range(len(groups))]
        if len(groups) == 1:
            results = self._write_file(planner, names[0], groups[0])
        else:
            results = self._write_in_parallel(planner, names, groups)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_in_parallel(
        self, planner: SavePlanner, names: list[str], groups: list[list[WriteItem]]
    ) -> list[WriteResult]:
        # As DCP with several threads: no copy-ahead loader (it serialises CUDA streams).
        copy_ahead, self.per_thread_copy_ahead = self.per_thread_copy_ahead, 0
        try:
            with ThreadPoolExecutor(len(groups), thread_name_prefix="bigclip-dcp-write") as pool:
                futures = [pool.submit(self._write_file, planner, n, g) for n, g in zip(names, groups)]
                return [r for f in futures for r in f.result()]  # every write ends before `with` does
        finally:
            self.per_thread_copy_ahead = copy_ahead

    def _write_file(self, planner: SavePlanner, name: str, items: list[WriteItem]) -> list[WriteResult]:
        """Write one object, again after a backoff while S3 kept throttling it."""
        path = self.fs.concat_path(self.path, name)
        for attempt in range(REWRITES + 1):
            files: queue.Queue[Any] = queue.Queue()
            files.put((path, name, items))
            try:
                # DCP's per-queue writer (FileSystemWriter._write_data, the same in torch 2.11 and
                # 2.13): with thread_count 1 it writes in this thread and raises what failed.
                return self._write_data(planner, files).wait()
            except Exception as e:
                # A throttled upload is dead already (the CRT aborts the multipart upload when a
                # request runs out of tries), so writing the same key again races with nothing.
                if attempt == REWRITES or not is_throttled(e):
                    raise
                delay = rewrite_delay(attempt)
                log.info("%s: S3 kept throttling after the client's tries (%s); writing it again in %.1f s "
                         "(%d of %d)", path, e, delay, attempt + 1, REWRITES)  # fmt: skip
                time.sleep(delay)
        raise AssertionError("unreachable")
