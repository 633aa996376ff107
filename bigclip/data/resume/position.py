"""The data-loader position: which samples of the epoch have been consumed, independent of world size.

Every shard is read sequentially by exactly one reader, so what has been consumed of a
shard is always a prefix, described by a `Cursor` (next sample index + tar byte offset).
The position of an epoch is therefore:
  done     shards whose every sample has been consumed (or skipped as corrupt)
  cursors  partially consumed shards -> where to continue
  samples  samples consumed in the epoch, all ranks together
Untouched shards are implicit. Nothing here mentions ranks or workers, so a position saved
at N ranks x W workers loads at any M x V: the remaining shards are re-planned over the new
readers, each partial shard continuing at its cursor.

Each rank records its own `RankProgress` on the consumer side (the main process, as batches
are handed to the training loop, not as workers prefetch them); `merge` combines all ranks'
progress with the position the loader started from. `to_json` is small: a bitmap of done
shards (5 KB for 41k shards) plus one cursor per shard being read.

With --dataset-resampled, the epoch's shards are an endless global sequence of draws
(randomness.draws_key), and the same description applies with draws in place of shards:
`done` and `cursors` are keyed by draw index, and `draws` is the frontier, the first draw
from which on nothing has been consumed. A resume at any world size deals the unfinished
draws below the frontier (partial ones at their cursors) and then the draws from the
frontier on, so no draw is read twice or skipped.

`stream`, when present, is what it takes to continue the exact same stream at the same
settings (stream_state.py); a resume at other settings ignores it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field, replace
from typing import Any

from bigclip.data.resume.stream_state import RankStream, StreamState
from bigclip.data.shards import ShardList
from bigclip.data.tar_samples import Cursor
from bigclip.errors import DataError

FORMAT = "bigclip.data.position/1"


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

    cursors: dict[int, Cursor] = field(default_factory=dict)  # consumed up to here
    ends: dict[int, Cursor] = field(default_factory=dict)  # a shard's reader found no valid sample after this
    samples: int = 0
    stream: RankStream | None = None  # filled in just before the gather

    def consume(self, shard: int, after: Cursor) -> None:
        self.cursors[shard] = after
        self.samples += 1


@dataclass
class DataPosition:
    epoch: int
    num_shards: int
    fingerprint: str
    resampled: bool = False
    samples: int = 0
    done: set[int] = field(default_factory=set)
    cursors: dict[int, Cursor] = field(default_factory=dict)
    stream: StreamState | None = None
    draws: int = 0  # --dataset-resampled: nothing consumed from draws >= this one

    @property
    def tasks(self) -> int:
        """How many task ids (shards, or draws below the frontier) `done` and `cursors` range over."""
        return self.draws if self.resampled else self.num_shards

    @classmethod
    def start_of(cls, epoch: int, shards: ShardList, *, resampled: bool) -> DataPosition:
        return cls(epoch=epoch, num_shards=len(shards), fingerprint=shards.fingerprint, resampled=resampled)

    def cursor(self, shard: int) -> Cursor:
        return self.cursors.get(shard, Cursor(0, 0))

    def without_stream(self) -> DataPosition:
        return replace(self, done=set(self.done), cursors=dict(self.cursors), stream=None)

    def merge(self, progress: list[RankProgress]) -> DataPosition:
        """This position advanced by every rank's progress (each shard is read by one rank only).

        The result has no stream state: only the loader knows the settings and origin to add.
        """
        merged = DataPosition(
            epoch=self.epoch,
            num_shards=self.num_shards,
            fingerprint=self.fingerprint,
            resampled=self.resampled,
            samples=self.samples + sum(p.samples for p in progress),
            done=set(self.done),
            cursors=dict(self.cursors),
            draws=self.draws,
        )
        for p in progress:
            merged.cursors.update(p.cursors)
            for shard, end in p.ends.items():
                if merged.cursor(shard).index >= end.index:
                    merged.done.add(shard)
        for shard in merged.done:
            merged.cursors.pop(shard, None)
        if self.resampled:
            merged.draws = max([merged.draws, *(d + 1 for d in merged.done | set(merged.cursors))])
        return merged

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
                "cursors": {str(s): c.to_json() for s, c in sorted(self.cursors.items())},
            }
            | ({"draws": self.draws} if self.resampled else {})
            | stream
        )

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> DataPosition:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise DataError(f"not a bigclip data position (expected format {FORMAT!r}): {str(state)[:200]}")
        try:
            count, resampled = int(state["shards"]["count"]), state["mode"] == "resampled"
            # A resampled position from before draws were numbered has none: a fresh stream.
            draws, legacy = int(state.get("draws", 0)), resampled and "draws" not in state
            return cls(
                epoch=int(state["epoch"]),
                num_shards=count,
                fingerprint=str(state["shards"]["fingerprint"]),
                resampled=resampled,
                samples=int(state["samples"]),
                done=decode_bitmap(state["done"], draws if resampled else count),
                cursors={int(s): Cursor.from_json(c) for s, c in state["cursors"].items()},
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
