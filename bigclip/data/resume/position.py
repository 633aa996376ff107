"""The data-loader position: which samples of the epoch have been consumed, independent of world size.

Every piece of a shard (the whole shard, or the part of it one rank was given: spans.py) is
read sequentially by exactly one reader, so what has been consumed of a piece is always a
prefix, and what is left of a shard is a few spans, each starting at a `Cursor` (next sample
index + tar byte offset). The position of an epoch is therefore:
  done     shards whose every sample has been consumed (or skipped as corrupt)
  spans    partially consumed shards -> what is left of them, where to continue
  samples  samples consumed in the epoch, all ranks together
Untouched shards are implicit. Nothing here mentions ranks or workers, so a position saved
at N ranks x W workers loads at any M x V: the remaining spans are re-planned over the new
readers, each continuing at its cursor.

Each rank records its own `RankProgress` on the consumer side (the main process, as batches
are handed to the training loop, not as workers prefetch them), keyed by piece; `merge`
combines all ranks' progress with the position the loader started from. `to_json` is small: a
bitmap of done shards (5 KB for 41k shards), one cursor per shard read by one reader
("cursors", the format's first version) and the spans of shards split between readers.

With --dataset-resampled, the epoch's shards are an endless global sequence of draws
(randomness.draws_key), and the same description applies with draws in place of shards:
`done` and `spans` are keyed by draw index (draws are never split), and `draws` is the
frontier, the first draw from which on nothing has been consumed. A resume at any world size
deals the unfinished draws below the frontier (partial ones at their cursors) and then the
draws from the frontier on, so no draw is read twice or skipped.

`stream`, when present, is what it takes to continue the exact same stream at the same
settings (stream_state.py); a resume at other settings ignores it, and so does a position of
the format's first version, whose readers were planned by an older assignment.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field, replace
from typing import Any

from bigclip.data.resume.spans import PieceKey, Span, consumed_through, stop_of, subtract
from bigclip.data.resume.stream_state import RankStream, StreamState
from bigclip.data.shards import ShardList
from bigclip.data.tar_samples import Cursor
from bigclip.errors import DataError

FORMAT = "bigclip.data.position/2"
FIRST_FORMAT = "bigclip.data.position/1"  # read: shards whole, one cursor each; its stream is not continued


def encode_bitmap(indices: set[int], size: int) -> str:
    bits = bytearray((size + 7) // 8)
    for i in indices:
        bits[i // 8] |= 1 << (i % 8)
    return base64.b64encode(bytes(bits)).decode("ascii")


def decode_bitmap(text: str, size: int) -> set[int]:
    bits = base64.b64decode(text)
    return {i for i in range(size) if bits[i // 8] >> (i % 8) & 1}


@dataclass
class RankProgress:
    """What one rank has consumed and learned since its loader started (picklable, for the gather)."""

    cursors: dict[PieceKey, Cursor] = field(default_factory=dict)  # a piece consumed up to here
    ends: dict[PieceKey, Cursor] = field(default_factory=dict)  # its reader found no valid sample after this
    samples: int = 0
    stream: RankStream | None = None  # filled in just before the gather

    def consume(self, piece: PieceKey, after: Cursor) -> None:
        self.cursors[piece] = after
        self.samples += 1


@dataclass
class DataPosition:
    epoch: int
    num_shards: int
    fingerprint: str
    resampled: bool = False
    samples: int = 0
    done: set[int] = field(default_factory=set)
    spans: dict[int, tuple[Span, ...]] = field(default_factory=dict)
    stream: StreamState | None = None
    draws: int = 0  # --dataset-resampled: nothing consumed from draws >= this one

    @property
    def tasks(self) -> int:
        """How many task ids (shards, or draws below the frontier) `done` and `spans` range over."""
        return self.draws if self.resampled else self.num_shards

    @classmethod
    def start_of(cls, epoch: int, shards: ShardList, *, resampled: bool) -> DataPosition:
        return cls(epoch=epoch, num_shards=len(shards), fingerprint=shards.fingerprint, resampled=resampled)

    def left(self, shard: int) -> tuple[Span, ...]:
        """What is left of a shard (or draw): nothing when done, all of it when untouched."""
        if shard in self.done:
            return ()
        return self.spans.get(shard, (Span(),))

    def without_stream(self) -> DataPosition:
        return replace(self, done=set(self.done), spans=dict(self.spans), stream=None)

    def merge(self, progress: list[RankProgress]) -> DataPosition:
        """This position advanced by every rank's progress (each shard is read by one rank only).

        The result has no stream state: only the loader knows the settings and origin to add.
        """
        samples = self.samples + sum(p.samples for p in progress)
        merged = replace(self, samples=samples, done=set(self.done), spans=dict(self.spans), stream=None)
        for p in progress:
            for (shard, first, _), after in p.cursors.items():
                merged.set_left(shard, subtract(merged.left(shard), first, after.index, after))
        for p in progress:  # once every rank's consumption is in
            for piece, end in p.ends.items():
                shard, first, stop = piece[0], piece[1], stop_of(piece)
                if consumed_through(merged.left(shard), first, end.index):
                    merged.set_left(shard, subtract(merged.left(shard), first, stop, Cursor(-1, -1)))
        if self.resampled:
            merged.draws = max([merged.draws, *(d + 1 for d in merged.done | set(merged.spans))])
        return merged

    def set_left(self, shard: int, left: tuple[Span, ...]) -> None:
        self.spans.pop(shard, None)
        if not left:
            self.done.add(shard)
        elif left != (Span(),):
            self.spans[shard] = left

    def to_json(self) -> dict[str, Any]:
        stream = {"stream": self.stream.to_json()} if self.stream is not None else {}
        return (
            {
                "format": FORMAT,
                "epoch": self.epoch,
                "mode": "resampled" if self.resampled else "shards",
                "samples": self.samples,
                "shards": {"count": self.num_shards, "fingerprint": self.fingerprint},
                "done": encode_bitmap(self.done, self.tasks),
                "cursors": {str(s): v[0].start.to_json() for s, v in sorted(self.spans.items()) if _whole(v)},
            }
            | _split_spans_json(self.spans)
            | ({"draws": self.draws} if self.resampled else {})
            | stream
        )

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> DataPosition:
        if not isinstance(state, dict) or state.get("format") not in (FORMAT, FIRST_FORMAT):
            raise DataError(f"not a bigclip data position (expected format {FORMAT!r}): {str(state)[:200]}")
        try:
            count, resampled = int(state["shards"]["count"]), state["mode"] == "resampled"
            # A resampled position from before draws were numbered has none: a fresh stream.
            draws, legacy = int(state.get("draws", 0)), resampled and "draws" not in state
            legacy = legacy or state["format"] == FIRST_FORMAT
            return cls(
                epoch=int(state["epoch"]),
                num_shards=count,
                fingerprint=str(state["shards"]["fingerprint"]),
                resampled=resampled,
                samples=int(state["samples"]),
                done=decode_bitmap(state["done"], draws if resampled else count),
                spans=_spans_from_json(state),
                stream=StreamState.from_json(state["stream"]) if "stream" in state and not legacy else None,
                draws=draws,
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise DataError(
                f"malformed data position ({type(e).__name__}: {e}); was the checkpoint edited?"
            ) from e

    def check_compatible(self, shards: ShardList, *, epoch: int, resampled: bool) -> None:
        """Raise `DataError` unless this position can continue `epoch` over `shards`."""
        if self.epoch != epoch:
            raise DataError(f"the data position is for epoch {self.epoch}, but epoch {epoch} was requested")
        if self.resampled != resampled:
            mode = "with" if self.resampled else "without"
            raise DataError(
                f"the checkpoint was saved {mode} --dataset-resampled; resume with the same setting"
            )
        if (self.fingerprint, self.num_shards) != (shards.fingerprint, len(shards)):
            raise DataError(
                f"the training shards changed since the checkpoint was saved ({self.num_shards} shards then, "
                f"{len(shards)} now, or a different list or --train-data-upsampling-factors): resume with the "
                "same --train-data, or start a new epoch without the saved data position"
            )


def _whole(spans: tuple[Span, ...]) -> bool:
    """One span to the shard's end: written as a plain cursor (the first format's "cursors")."""
    return len(spans) == 1 and spans[0].stop is None


def _split_spans_json(spans: dict[int, tuple[Span, ...]]) -> dict[str, Any]:
    split = {str(s): [span.to_json() for span in v] for s, v in sorted(spans.items()) if not _whole(v)}
    return {"spans": split} if split else {}


def _spans_from_json(state: dict[str, Any]) -> dict[int, tuple[Span, ...]]:
    spans = {int(s): (Span(Cursor.from_json(c)),) for s, c in state["cursors"].items()}
    for s, rows in state.get("spans", {}).items():
        spans[int(s)] = tuple(Span.from_json(row) for row in rows)
    return spans
