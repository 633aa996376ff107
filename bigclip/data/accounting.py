"""Every epoch accounts for its samples: one log line per epoch, from counts gathered over all ranks.

    account = loader.account_epoch()   # collective, at the epoch's end; rank 0 logs the line
    # data: epoch 0 read 288 of the 300 samples sizes.json lists (12 not read) in 18 of 18 planned
    #   steps; corrupt samples skipped: 0; empty shards: 1 (/data/00003.tar); damaged shards: 0

What an epoch can lose, and where it shows: samples whose image or caption does not decode
(skipped, counted by reason); a damaged or truncated shard (its samples before the damage are
kept, the rest skipped, the shard named); an empty shard (named); a shard whose count differs
from sizes.json (named with both counts: the balanced plan rests on them); and, when some rank
runs out before the planned steps (sizes unknown, or the losses above), the steps and samples
the epoch fell short by, with the ranks that ran out. The line is a warning whenever any of
these is not zero, so a shortfall is never silent. Counts of skipped samples and damaged
shards cover the epoch since the loader started (after a resume: since the resume).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bigclip.data.streams import data_location
from bigclip.errors import DataError
from bigclip.storage.access_checks import endpoint_unreachable, run_check

log = logging.getLogger("bigclip.data")
NAMED = 5  # shards named per kind in the line; the counts are always whole
# A shard's count "found" when a sample follows its last listed one: the plan stops reading there.
MORE_THAN_LISTED = -2


@dataclass
class RankCounts:
    """One rank's part (picklable, for the gather)."""

    skipped: dict[str, int]
    broken: list[str]
    empty: list[str]
    mismatched: dict[str, list[int]]  # url -> [found (or MORE_THAN_LISTED), listed]
    ran_dry: bool


@dataclass
class DataStats:
    """This rank's counters since the loader started (for logging; the loop may all-reduce them)."""

    samples: int = 0  # handed to the training loop
    skipped: Counter = field(default_factory=Counter)  # corrupt samples by reason (see decode.py)
    broken_shards: list[str] = field(default_factory=list)  # truncated / unreadable shards
    empty_shards: list[str] = field(default_factory=list)
    mismatched: dict[str, list[int]] = field(default_factory=dict)  # url -> [found, sizes.json's count]
    readers: int = 1  # workers producing in parallel (1 with --workers 0)
    produced: int = 0  # samples in worker batches received since the last take_capacity()
    busy_s: float = 0.0  # the workers' summed busy time for them

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def learn(self, worker_batch: dict[str, Any]) -> None:
        """Counts that arrive with a worker batch, whether or not its samples are consumed yet."""
        self.skipped.update(worker_batch["skipped"])
        self.broken_shards.extend(worker_batch["broken"])
        self.empty_shards.extend(worker_batch["empty"])
        note_mismatches(self.mismatched, worker_batch["mismatched"])
        self.produced += len(worker_batch["keys"])
        self.busy_s += worker_batch["busy_s"]

    def rank_counts(self, *, ran_dry: bool) -> RankCounts:
        return RankCounts(dict(self.skipped), self.broken_shards, self.empty_shards, self.mismatched, ran_dry)

    def take_capacity(self) -> float:
        """Samples/s the workers could deliver since the last call (0.0 if nothing was received)."""
        capacity = self.produced * self.readers / self.busy_s if self.busy_s > 0 else 0.0
        self.produced, self.busy_s = 0, 0.0
        return capacity


@dataclass
class EpochAccount:
    epoch: int
    samples: int  # handed to training in the epoch by all ranks (before a resume included)
    steps: int
    planned_steps: int
    global_batch: int
    listed: int | None  # sizes.json's total, when it covers every shard (and samples are not resampled)
    resampled: bool = False  # --dataset-resampled: drawn with replacement, no total to read
    corrupt: Counter = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    mismatched: dict[str, list[int]] = field(default_factory=dict)
    dry_ranks: list[int] = field(default_factory=list)

    @property
    def short(self) -> bool:
        return self.steps < self.planned_steps

    @property
    def clean(self) -> bool:
        return not (self.short or sum(self.corrupt.values()) or self.broken or self.empty or self.mismatched)

    def line(self) -> str:
        head = f"epoch {self.epoch} read {self.samples}"
        if self.listed is not None:
            head += f" of the {self.listed} samples sizes.json lists ({self.listed - self.samples} not read)"
        elif self.resampled:
            head += " samples (drawn with replacement: --dataset-resampled)"
        else:
            head += " samples (sizes.json does not list every shard)"
        head += f" in {self.steps} of {self.planned_steps} planned steps"
        if self.short:
            head += self._shortfall()
        corrupt = sum(self.corrupt.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.corrupt.items()))
        parts = [head, f"corrupt samples skipped: {corrupt}" + (f" ({reasons})" if corrupt else "")]
        parts.append(f"empty shards: {_named(self.empty)}")
        parts.append(f"damaged shards (read up to the damage): {_named(self.broken)}")
        if self.mismatched:
            counts = [f"{u}: {_found(found, listed)} found, {listed} listed" for u, (found, listed) in
                      sorted(self.mismatched.items())]  # fmt: skip
            parts.append(
                f"shards whose sample count differs from sizes.json: {len(counts)} ({'; '.join(counts[:NAMED])}); "
                "recount them with `bigclip index-shards PATTERN`"
            )
        return "; ".join(parts)

    def _shortfall(self) -> str:
        missing = (self.planned_steps - self.steps) * self.global_batch
        who = f"rank(s) {', '.join(map(str, self.dry_ranks))} ran out of data" if self.dry_ranks else ""
        fix = (
            " (run `bigclip index-shards PATTERN` so that the ranks get equal shares)"
            if self.listed is None
            else ""
        )
        return f", SHORT by {self.planned_steps - self.steps} steps ({missing} samples): {who}{fix}"


def _found(found: int, listed: int) -> str:
    return f"more than {listed} (the rest not read)" if found == MORE_THAN_LISTED else str(found)


def _named(urls: list[str]) -> str:
    if not urls:
        return "0"
    more = f", +{len(urls) - NAMED} more" if len(urls) > NAMED else ""
    return f"{len(urls)} ({', '.join(urls[:NAMED])}{more})"


def combine(account: EpochAccount, ranks: list[RankCounts]) -> EpochAccount:
    """`account` with every rank's counts added (shards named once each, sorted)."""
    for rank, counts in enumerate(ranks):
        account.corrupt.update(counts.skipped)
        account.broken += counts.broken
        account.empty += counts.empty
        account.mismatched |= counts.mismatched
        if counts.ran_dry:
            account.dry_ranks.append(rank)
    account.broken, account.empty = sorted(set(account.broken)), sorted(set(account.empty))
    return account


def note_mismatches(known: dict[str, list[int]], new: dict[str, list[int]]) -> None:
    """Add shards whose count differs from sizes.json, warning at once about each new one (the
    balanced plan rests on those counts, so the epoch may end short)."""
    for url, (found, listed) in new.items():
        if url not in known and found == MORE_THAN_LISTED:
            log.warning("shard %s holds more samples than the %d sizes.json lists: the epoch's plan reads those "
                        "%d and not the rest; recount with `bigclip index-shards PATTERN`", url, listed, listed)  # fmt: skip
        elif url not in known:
            log.warning(
                "shard %s holds %d samples, sizes.json lists %s: the epoch's plan is off; recount with "
                "`bigclip index-shards PATTERN`", url, found, listed if listed >= 0 else "none",
            )  # fmt: skip
        known[url] = [found, listed]


def no_batch_error(stats: DataStats, *, epoch: int, batch_size: int, pattern: str, rank: int) -> DataError:
    skipped = ", ".join(f"{k}: {v}" for k, v in sorted(stats.skipped.items())) or "none"
    broken, empty = stats.broken_shards, stats.empty_shards
    gone = unreachable(broken[0]) if broken else ""
    if gone:
        return DataError(
            f"epoch {epoch}: {len(broken)} shard(s) could not be read ({broken[:3]}), not because they are damaged: "
            f"their storage does not answer now: {gone}. Once it answers, resume with --resume latest"
        )
    return DataError(
        f"epoch {epoch}: not every rank could fill one batch of {batch_size} samples from {pattern!r} (rank "
        f"{rank} skipped {stats.skipped_total} corrupt samples: {skipped}; damaged shards: {len(broken)} "
        f"{broken[:3]}; empty shards: {len(empty)} {empty[:3]}). Check or replace those shards, or use fewer "
        "ranks or a smaller --batch-size"
    )


def unreachable(url: str, *, timeout_s: float = 20.0) -> str:
    """Why `url`'s storage does not answer now ('' when it does): asked when shards failed to read,
    so an endpoint that went away is not reported as damaged shards."""

    def ask() -> str:
        folder, _, name = url.rpartition("/")
        return str(data_location(folder or ".", fast_fail=True).exists(name))  # few tries: it failed already

    result = run_check("read", ask, timeout_s=timeout_s)
    return "" if result.ok or not endpoint_unreachable(result.detail) else result.detail


def report(account: EpochAccount, *, rank: int) -> None:
    if rank != 0:
        return
    if account.clean:
        log.info("data: %s", account.line())
    else:
        log.warning("data: %s", account.line())
