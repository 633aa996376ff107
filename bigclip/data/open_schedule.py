"""When each reader may open its first shards at an epoch's start: spread, not all in one instant.

At an epoch's start every reader of every rank opens `--shard-interleave` shards (one GET each on
an object store): 1024 ranks x 8 workers x 4 = 32,768 GETs in the same second, against S3's
~5,500 GETs a second per prefix, which answers the rest with 503 SlowDown. So the first opens
are spread at `OPEN_RATE` a second over the whole job: the epoch's `world x readers x interleave`
first opens take `spread = that / rate` seconds (16 s at 1024 x 8 x 4; 0.03 s at 2 x 8 x 2).

The order follows what the ranks need first: a rank consumes its workers' batches in round robin
(batching.py), so its k-th worker in that order is needed at about the k-th step. Reader slot k
(k-th in the round robin) of every rank opens in the k-th of `readers` equal windows of the
spread, rank r at the fraction r / world of it, so the opens of all ranks follow one another at
an even pace and the first step waits at most spread / readers. Only the time changes: what each reader reads, and
in which order, is the same as without the schedule (exact resume does not depend on it).
Local shards (a path or file://) are not spread: a local disk has no request rate to respect.
"""

from __future__ import annotations

OPEN_RATE = 2000.0  # first opens a second, all ranks together: well below S3's ~5,500 GETs/s per prefix


def open_delays(
    *, rank: int, world_size: int, readers: int, interleave: int, rate: float | None
) -> list[float]:
    """Seconds after the epoch's start at which each of this rank's reader slots may open shards
    (slot k: the k-th worker in the rank's round robin); all 0 when `rate` is None."""
    if rate is None or rate <= 0:
        return [0.0] * readers
    spread = world_size * readers * interleave / rate
    window = spread / readers
    return [window * (k + rank / world_size) for k in range(readers)]
