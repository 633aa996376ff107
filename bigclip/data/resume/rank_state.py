"""A rank's own data state for a checkpoint, and the global position every rank's state adds up to.

    mine = loader.rank_state()                   # no collective; JSON-able; O(1) in world size
    continues_alone(mine, world_size=n, workers=w, batch_size=b, interleave=i, seed=s)
        True:  TrainLoader(position=mine) continues this rank's exact stream
    merge_rank_states([rank 0's, ..., rank n-1's]) -> the global position (position.py), which
        TrainLoader(position=...) resumes at any world size: every sample once

A rank's state (format bigclip.data.rank_state/1) holds:
  rank, settings  the stream it belongs to (world size, workers, batch size, interleave, seed)
  epoch, mode, shards, samples   as the global position does (samples: all ranks together)
  origin   samples and draws of the position the stream's plan was made from: they key its readers
           and place their tails (--dataset-resampled)
  plans    per worker, the pieces of shards (draws) dealt to this rank's readers, with the cursor
           each starts at: the plan itself, so that continuing needs no global position
  left     what is left of each of this rank's pieces, and of the draws its readers took past their
           plans, as spans (spans.py), after the last sample handed to training
  stream   its readers' states, round robin and carry (stream_state.py); null once some rank ran dry
Its size is O(this rank's pieces + readers x interleave): with the shards fixed, it shrinks as the
world grows. Every piece is read by one rank only, so the global position is the union of the
ranks' `left`; a shard no rank lists (a draw below the origin's frontier) was done before the plan.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from typing import Any

from bigclip.data.resume.assignment import ReaderAssignment, ShardTask, Tail, reader_tails, tasks_of
from bigclip.data.resume.position import DataPosition
from bigclip.data.resume.reader_state import ReaderState
from bigclip.data.resume.spans import NO_STOP, Span
from bigclip.data.resume.stream_state import RankStream, StreamSettings
from bigclip.data.shards import ShardList
from bigclip.data.tar_samples import Cursor
from bigclip.errors import DataError

log = logging.getLogger("bigclip.data")

FORMAT = "bigclip.data.rank_state/1"
Left = dict[int, tuple[Span, ...]]


def is_rank_state(position: object) -> bool:
    return isinstance(position, dict) and position.get("format") == FORMAT


@dataclass
class RankState:
    rank: int
    settings: StreamSettings
    epoch: int
    num_shards: int
    fingerprint: str
    resampled: bool
    samples: int
    origin_samples: int
    origin_draws: int
    plans: list[list[tuple[int, Cursor, int | None]]]  # per worker: (shard or draw, start, stop)
    left: Left
    stream: RankStream | None

    @classmethod
    def build(
        cls,
        *,
        rank: int,
        settings: StreamSettings,
        now: DataPosition,
        samples: int,
        origin: DataPosition,
        plans: list[list[ShardTask]],
        readers: list[ReaderState],
        stream: RankStream | None,
    ) -> RankState:
        """This rank's state, from `now` (a position right at least on this rank's pieces) and the
        samples all ranks have consumed in the epoch."""
        tails = reader_tails(origin, settings, rank=rank)
        return cls(
            rank, settings, now.epoch, now.num_shards, now.fingerprint, now.resampled, samples,
            origin.samples, origin.draws, [[(t.shard, t.start, t.stop) for t in plan] for plan in plans],
            share(now, plans, tails, readers), stream,
        )  # fmt: skip

    def start(self) -> DataPosition:
        """The epoch, shards and samples of this state as a position; its done and spans are only this
        rank's share (`local()`): enough to start a loader, not a global position."""
        return DataPosition(self.epoch, self.num_shards, self.fingerprint, self.resampled, self.samples,
                            draws=self.origin_draws)  # fmt: skip

    def local(self) -> DataPosition:
        """A position right on this rank's pieces (and the draws its readers took), wrong elsewhere."""
        position = self.start()
        for task, spans in self.left.items():
            position.set_left(task, spans)
        return position

    def assignment(self, shards: ShardList) -> ReaderAssignment:
        """The saved plan and stream, to continue exactly (the caller checked `continues_alone`)."""
        assert self.stream is not None
        origin = replace(self.start(), samples=self.origin_samples)
        seed, epoch, resampled = self.settings.seed, self.epoch, self.resampled
        tasks = [tasks_of(shards, plan, seed=seed, epoch=epoch, resampled=resampled) for plan in self.plans]
        tails = reader_tails(origin, self.settings, rank=self.rank)
        return ReaderAssignment(origin, tasks, self.stream, tails)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "rank": self.rank,
            "settings": asdict(self.settings),
            "epoch": self.epoch,
            "mode": "resampled" if self.resampled else "shards",
            "shards": {"count": self.num_shards, "fingerprint": self.fingerprint},
            "samples": self.samples,
            "origin": {"samples": self.origin_samples, "draws": self.origin_draws},
            "plans": [
                [[t, c.index, c.byte, NO_STOP if s is None else s] for t, c, s in p] for p in self.plans
            ],
            "left": {str(t): [span.to_json() for span in spans] for t, spans in sorted(self.left.items())},
            "stream": self.stream.to_json() if self.stream is not None else None,
        }

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> RankState:
        if not is_rank_state(state):
            raise DataError(f"not a bigclip data rank state (expected format {FORMAT!r}): {str(state)[:200]}")
        try:
            settings = StreamSettings.from_json(state["settings"])
            plans = [[(int(t), Cursor(int(i), int(b)), None if s == NO_STOP else int(s)) for t, i, b, s in plan]
                     for plan in state["plans"]]  # fmt: skip
            left = {int(t): tuple(Span.from_json(row) for row in rows) for t, rows in state["left"].items()}
            stream = RankStream.from_json(state["stream"]) if state["stream"] is not None else None
            if stream is not None:
                stream.check(settings.readers)
            origin, shards = state["origin"], state["shards"]
            return cls(
                int(state["rank"]), settings, int(state["epoch"]), int(shards["count"]), str(shards["fingerprint"]),
                state["mode"] == "resampled", int(state["samples"]), int(origin["samples"]), int(origin["draws"]),
                plans, left, stream,
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise DataError(
                f"malformed data rank state ({type(e).__name__}: {e}); was the checkpoint edited?"
            ) from e


def own_assignment(
    saved: RankState, shards: ShardList, settings: StreamSettings, *, rank: int
) -> ReaderAssignment:
    """The plan and stream `saved` holds, for the same rank at the same settings; DataError otherwise."""
    changes = settings.changes_from(saved.settings)
    if saved.rank != rank or changes or saved.stream is None:
        why = (
            f"it is rank {saved.rank}'s" if saved.rank != rank
            else ", ".join(changes) if changes
            else "its stream ended where a rank ran out of data"
        )  # fmt: skip
        raise DataError(
            f"rank {rank}: a rank's own data state continues only its exact stream, and this one cannot ({why}): "
            "merge every rank's state (bigclip.data.resume.rank_state.merge_rank_states) and resume from the merged position"
        )
    if rank == 0:
        log.info("data: continuing the saved stream exactly from each rank's own state (epoch %d, %d samples in)",
                 saved.epoch, saved.samples)  # fmt: skip
    return saved.assignment(shards)


def continues_alone(
    state: dict[str, Any], *, world_size: int, workers: int, batch_size: int, interleave: int, seed: int
) -> bool:
    """Whether a loader with these settings continues the exact stream from this rank's own state
    alone (else: merge every rank's state). Collective use: every rank must get the same answer, so
    all-reduce it (MIN) before choosing."""
    saved = RankState.from_json(state)
    settings = StreamSettings(world_size, workers, batch_size, interleave, seed)
    return saved.stream is not None and not settings.changes_from(saved.settings)


def share(now: DataPosition, plans: list[list[ShardTask]], tails: list[Tail | None],
          readers: list[ReaderState]) -> Left:  # fmt: skip
    """What is left of this rank's pieces in `now`, and of the draws its readers took past their plans
    that `now` shows touched (untouched ones are implicit: above the origin's frontier)."""
    left: defaultdict[int, list[Span]] = defaultdict(list)
    for plan, tail, reader in zip(plans, tails, readers):
        for task in plan:
            left[task.shard] += restrict(now.left(task.shard), task.start.index, task.stop)
        for k in range(max(0, reader.tasks - len(plan)) if tail is not None else 0):
            draw = tail.draw(k)
            if draw in now.done or draw in now.spans:
                left[draw] += now.left(draw)
    return {task: coalesce(spans) for task, spans in left.items()}


def restrict(spans: tuple[Span, ...], first: int, stop: int | None) -> list[Span]:
    """The parts of `spans` within samples [first, stop); a part cut at `first` starts there, byte unknown."""
    out = []
    for span in spans:
        if (span.stop is not None and span.stop <= first) or (stop is not None and span.start.index >= stop):
            continue
        begin = span.start if span.start.index >= first else Cursor(first, -1)
        end = span.stop if stop is None or (span.stop is not None and span.stop <= stop) else stop
        out.append(Span(begin, end))
    return out


def coalesce(spans: list[Span]) -> tuple[Span, ...]:
    """Sorted, with a span that continues where the previous one stops (byte unknown) joined to it,
    so that the pieces of an untouched shard read as the whole shard, Span(), as the plan saw it."""
    out: list[Span] = []
    for span in sorted(spans, key=lambda s: s.start.index):
        last = out[-1] if out else None
        if last is not None and last.stop == span.start.index and span.start.byte == -1:
            out[-1] = Span(last.start, span.stop)
        else:
            out.append(span)
    return tuple(out)


def merge_rank_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's state (rank 0 to n-1, from one save) -> the global position, world-size free (no
    stream state: it resumes at any world size, every sample once). Pure: no collective."""
    ranks = _checked([RankState.from_json(s) for s in states])
    first = ranks[0]
    listed: defaultdict[int, list[Span]] = defaultdict(list)
    for rank in ranks:
        for task, spans in rank.left.items():
            listed[task] += spans
    position = first.start()
    for task, spans in listed.items():
        position.set_left(task, coalesce(spans))
    unplanned = range(first.origin_draws if first.resampled else first.num_shards)
    position.done |= {task for task in unplanned if task not in listed}  # done before the plan was made
    if first.resampled:
        position.draws = max([first.origin_draws, *(d + 1 for d in position.done | set(position.spans))])
    return position.to_json()


def _checked(ranks: list[RankState]) -> list[RankState]:
    """The states in rank order, refused unless they are one save's: every rank once, same stream and point."""
    if not ranks:
        raise DataError("no data rank state to merge")
    ranks = sorted(ranks, key=lambda r: r.rank)
    world = ranks[0].settings.world_size
    if [r.rank for r in ranks] != list(range(world)):
        raise DataError(
            f"the data states of ranks {[r.rank for r in ranks]} were given, but the run that saved them had "
            f"{world} ranks: every rank's state from one checkpoint is needed; was a file of it lost?"
        )
    point = lambda r: (r.settings, r.epoch, r.num_shards, r.fingerprint, r.resampled, r.samples,  # noqa: E731
                       r.origin_samples, r.origin_draws)  # fmt: skip
    if len({point(r) for r in ranks}) != 1:
        raise DataError(
            "the data states of the ranks are not from one save (their epoch, samples or stream differ); "
            "were files of different checkpoints mixed?"
        )
    return ranks
