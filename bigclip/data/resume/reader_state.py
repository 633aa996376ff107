"""A reader's state between two samples: everything it needs to continue its stream exactly.

A reader (one data worker of one rank) is described, between two samples, by:
  draws      interleave choices made so far (the next one is keyed by this count)
  tasks      shards (draws, with --dataset-resampled) taken from its plan, then its tail, so far
  emitted    valid samples emitted so far (its batches end at multiples of batch_size)
  fruitless  shards closed in a row without a valid sample (--dataset-resampled gives up at 100)
  open       its open shards, in order: the shard, the piece of it the reader reads (its first
             sample index when planned and its stop, -1 for the shard's end: resume/assignment.py
             may split a shard between ranks), the read cursor (the next sample to read, past
             corrupt samples already skipped), the cursor after the last valid sample (what the
             reader reports when it closes the shard), and whether that shard has given a valid
             sample since it was opened
Every sample a worker emits carries this state as it was right after that sample (as a row
of ints, so a batch carries a [B, width] tensor); the consumer keeps, per worker, the row of
the last sample it consumed. No data is needed to restore it: shard sizes play no part, and
corrupt samples and truncated shards are handled like everything else. (Replaying a reader's
draws from sizes.json instead cannot be exact: skipped corrupt samples and truncated shards
move its batch boundaries, and those decide the order in which the consumer takes batches.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from bigclip.data.tar_samples import Cursor
from bigclip.errors import DataError

HEADER = 5  # draws, tasks, emitted, fruitless, open shard count
PER_SHARD = 8  # shard, first, stop, read index, read byte, valid index, valid byte, fruitful
NO_STOP = -1  # a piece that runs to the shard's end
PADDING = -1


class ShardProgress(Protocol):
    """What a row records of an open shard (an `OpenShardState`, or the worker's live one)."""

    shard: int
    first: int
    stop: int | None
    read: Cursor
    valid: Cursor
    fruitful: bool


@dataclass(frozen=True)
class OpenShardState:
    shard: int
    first: int  # the piece: samples [first, stop) of the shard
    stop: int | None
    read: Cursor
    valid: Cursor
    fruitful: bool


def encode_row(
    draws: int, tasks: int, emitted: int, fruitless: int, shards: Sequence[ShardProgress], *, width: int = 0
) -> list[int]:
    """The flat int row of a reader state; padded with -1 to `width` when given (rows of one tensor).

    Called once per sample by the workers, straight from their live state: no objects made.
    """
    row = [draws, tasks, emitted, fruitless, len(shards)]
    for s in shards:
        stop = NO_STOP if s.stop is None else s.stop
        row += (
            s.shard,
            s.first,
            stop,
            s.read.index,
            s.read.byte,
            s.valid.index,
            s.valid.byte,
            int(s.fruitful),
        )
    return row + [PADDING] * (width - len(row))


@dataclass(frozen=True)
class ReaderState:
    draws: int = 0
    tasks: int = 0
    emitted: int = 0
    fruitless: int = 0
    open: tuple[OpenShardState, ...] = ()

    @staticmethod
    def width(interleave: int) -> int:
        """Length of a padded row for a reader with up to `interleave` open shards."""
        return HEADER + PER_SHARD * interleave

    def to_ints(self) -> list[int]:
        return encode_row(self.draws, self.tasks, self.emitted, self.fruitless, self.open)

    @classmethod
    def from_ints(cls, row: list[int]) -> ReaderState:
        try:
            draws, tasks, emitted, fruitless, count = (int(v) for v in row[:HEADER])
            fields = [
                [int(v) for v in row[HEADER + i * PER_SHARD : HEADER + (i + 1) * PER_SHARD]]
                for i in range(count)
            ]
            shards = tuple(
                OpenShardState(
                    f[0],
                    f[1],
                    None if f[2] == NO_STOP else f[2],
                    Cursor(f[3], f[4]),
                    Cursor(f[5], f[6]),
                    bool(f[7]),
                )
                for f in fields
            )
        except (TypeError, ValueError, IndexError) as e:
            raise DataError(
                f"malformed data-reader state {row[:40]!r}: {e}; was the checkpoint edited?"
            ) from e
        if min(draws, tasks, emitted, fruitless, count) < 0:
            raise DataError(f"malformed data-reader state {row[:40]!r}: negative counts")
        return cls(draws, tasks, emitted, fruitless, shards)
