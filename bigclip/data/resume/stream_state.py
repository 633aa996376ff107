"""The exact state of the training stream, saved beside the world-size-free position.

The position (position.py) says which samples of the epoch were consumed, whatever the world
size; resuming from it alone re-plans the rest over the new readers: every sample once, in
another order. When the settings saved here (world size, workers per rank, batch size,
interleave, seed; the shard list and epoch are checked by the position itself) equal the
resuming run's, the loader instead continues the very stream it was on, so a requeued run
trains bitwise as if never interrupted:
  origin   the position the stream's plan was made from (the epoch's start, or the last
           re-plan): the plan is recomputed from it, never re-dealt
  readers  per rank and worker, the reader's state right after the last sample consumed from
           it (reader_state.py); randomness is keyed by position, so it continues
  active   per rank, the workers still in the round robin, the next to deliver first
  carry    per rank, whose short last batches the re-batcher holds unconsumed, oldest first
Size: 5 + 8 x interleave ints per reader, about 2 MB of JSON at 1024 ranks x 8 workers x
interleave 4 (byte offsets of GB shards are most of it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from bigclip.data.resume.reader_state import ReaderState
from bigclip.errors import DataError


@dataclass(frozen=True)
class StreamSettings:
    """What must not change for a resumed stream to be the same stream."""

    world_size: int
    workers: int
    batch_size: int
    interleave: int
    seed: int

    @property
    def readers(self) -> int:
        """Readers per rank (--workers 0 reads in the training process: one reader)."""
        return max(1, self.workers)

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> StreamSettings:
        """From `asdict`'s dict (KeyError, TypeError or ValueError when malformed: the caller says where)."""
        return cls(**{f.name: int(state[f.name]) for f in fields(cls)})

    def changes_from(self, saved: StreamSettings) -> list[str]:
        """What differs from `saved`, as 'world_size 2 -> 3'; empty when the stream can continue."""
        return [
            f"{f.name} {getattr(saved, f.name)} -> {getattr(self, f.name)}"
            for f in fields(self)
            if getattr(saved, f.name) != getattr(self, f.name)
        ]


@dataclass
class RankStream:
    """One rank's part: its readers' states and the consumer's place in their batches."""

    readers: list[ReaderState]
    active: list[int]
    carry: list[int]

    @classmethod
    def fresh(cls, readers: int) -> RankStream:
        return cls([ReaderState() for _ in range(readers)], list(range(readers)), [])

    def to_json(self) -> dict[str, Any]:
        return {"readers": [r.to_ints() for r in self.readers], "active": self.active, "carry": self.carry}

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> RankStream:
        readers = [ReaderState.from_ints(row) for row in state["readers"]]
        return cls(readers, [int(w) for w in state["active"]], [int(w) for w in state["carry"]])

    def check(self, readers: int) -> None:
        workers = self.active + self.carry
        if (
            len(self.readers) != readers
            or len(set(workers)) != len(workers)
            or not set(workers) <= set(range(readers))
        ):
            raise ValueError(
                f"inconsistent reader states for {readers} readers: active {self.active}, carry {self.carry}"
            )


@dataclass
class StreamState:
    settings: StreamSettings
    origin: dict[str, Any]  # a DataPosition's JSON (without its own stream state)
    ranks: list[RankStream]

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "origin": self.origin,
            "ranks": [r.to_json() for r in self.ranks],
        }

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> StreamState:
        try:
            settings = StreamSettings.from_json(state["settings"])
            ranks = [RankStream.from_json(r) for r in state["ranks"]]
            if len(ranks) != settings.world_size:
                raise ValueError(f"{len(ranks)} ranks' states for world size {settings.world_size}")
            for rank in ranks:
                rank.check(settings.readers)
            return cls(settings, dict(state["origin"]), ranks)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(
                f"malformed stream state in the data position ({type(e).__name__}: {e}); was the checkpoint edited?"
            ) from e
