"""What is left of one shard: spans of sample indices, and pieces (what one reader is given).

A reader is given a *piece* of a shard, samples [first, stop) (stop None: to the shard's end),
and reads it front to back, so what it has consumed of its piece is always a prefix. Most
pieces are whole shards; the balanced plan (assignment.py) splits a shard between two ranks
where one rank's share of the epoch ends inside it. What is left of a shard is then a few
disjoint spans, each with the cursor it continues at:

    untouched           [Span(START)]                      (implicit in the position)
    read by one reader  [Span(Cursor(40, 81920))]          (a cursor, as before pieces existed)
    split at 60, both   [Span(Cursor(40, 81920), 60), Span(Cursor(75, 153600))]
    partly read

Consuming a piece's samples up to a cursor removes [first, cursor.index) from the spans; a
piece whose reader found nothing valid after what was consumed removes [first, stop).
"""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.data.tar_samples import START, Cursor

NO_STOP = -1  # in rows and JSON: a span or piece that runs to the shard's end

PieceKey = tuple[int, int, int]  # (shard or draw, first sample index, stop or NO_STOP)


@dataclass(frozen=True)
class Span:
    """Samples [start.index, stop) of a shard that are not consumed yet (stop None: to its end)."""

    start: Cursor = START
    stop: int | None = None

    def to_json(self) -> list[int]:
        return [self.start.index, self.start.byte, NO_STOP if self.stop is None else self.stop]

    @classmethod
    def from_json(cls, value: list[int]) -> Span:
        stop = int(value[2])
        return cls(Cursor(int(value[0]), int(value[1])), None if stop == NO_STOP else stop)

    def samples(self, size: int | None) -> int | None:
        """How many samples the span holds, given the shard's size (None when neither bound is known)."""
        end = self.stop if self.stop is not None else size
        return None if end is None else max(0, end - self.start.index)


def stop_of(key: PieceKey) -> int | None:
    return None if key[2] == NO_STOP else key[2]


def _below(index: int, stop: int | None) -> bool:
    return stop is None or index < stop


def subtract(spans: tuple[Span, ...], lo: int, hi: int | None, resume_at: Cursor) -> tuple[Span, ...]:
    """`spans` without samples [lo, hi); what is left after `hi` continues at `resume_at`.

    `resume_at` is the consuming reader's cursor (it carries the byte offset) when hi is its
    index; Cursor(hi, -1) (byte unknown: re-read from the shard's start) otherwise.
    """
    left: list[Span] = []
    for span in spans:
        s0, s1 = span.start.index, span.stop
        if not _below(lo, s1) or (hi is not None and s0 >= hi):
            left.append(span)  # no overlap
            continue
        if s0 < lo:
            left.append(Span(span.start, lo))
        if hi is not None and _below(hi, s1):
            left.append(Span(resume_at if resume_at.index == hi else Cursor(hi, -1), s1))
    return tuple(s for s in left if _below(s.start.index, s.stop))


def consumed_through(spans: tuple[Span, ...], first: int, end: int) -> bool:
    """Whether nothing of [first, end) is left in `spans` (a piece consumed up to `end`)."""
    return all((span.stop is not None and span.stop <= first) or span.start.index >= end for span in spans)
