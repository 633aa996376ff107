"""Every random choice of the training stream, as a function of where it is made, not of history.

A resumed run cannot replay the random draws of the run it continues without re-reading
everything that run read. So nothing here has a state that advances: each choice is keyed
by the position it is made at, and the same key gives the same choice in every process,
Python version and platform (the keys are hashed, never Python's salted `hash`).

    choose(key, draw, n)    which of n open shards a reader takes its draw-th sample from
    choose_weighted(key, draw, cumulative)   the same with weights (--train-data-upsampling-factors)
    keyed_rng(*parts)       a fresh generator, e.g. for one sample's random resized crop

Keys name what they stand for: a reader's stream key is (seed, epoch, plan origin, rank,
worker); a crop is keyed by (seed, epoch, shard, sample index), so a sample gets the same crop
in an epoch whatever world size reads it.
"""

from __future__ import annotations

import bisect
import hashlib
import random


def stream_key(*, seed: int, epoch: int, origin: int, rank: int, worker: int) -> str:
    """One reader's key: `origin` (samples consumed when its plan was made) tells re-plans apart."""
    return f"bigclip-reader/{seed}/{epoch}/{origin}/{rank}/{worker}"


def choose(key: str, draw: int, n: int) -> int:
    """An index in range(n) for the `draw`-th choice under `key` (64-bit hash: bias below n / 2**64)."""
    digest = hashlib.blake2b(f"{key}/{draw}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % n


def draws_key(*, seed: int, epoch: int) -> str:
    """The key of an epoch's global sequence of shard draws (--dataset-resampled)."""
    return f"bigclip-draws/{seed}/{epoch}"


def choose_weighted(key: str, draw: int, cumulative: list[float]) -> int:
    """An index i drawn with probability (cumulative[i] - cumulative[i-1]) / cumulative[-1]."""
    digest = hashlib.blake2b(f"{key}/{draw}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64 * cumulative[-1]
    return min(bisect.bisect_right(cumulative, u), len(cumulative) - 1)


def keyed_rng(*parts: object) -> random.Random:
    """A generator seeded from `parts` (a str seed is hashed with SHA-512: the same stream everywhere)."""
    return random.Random("/".join(str(p) for p in parts))
