"""How the chunked contrastive loss sees every rank's features: a stream of row chunks.

`exchange.stream(payload, ...)` yields `Chunk`s: `chunk` rows of one owner rank's payload tensors
(text features; in backward also their per-row statistics) plus fresh per-row accumulators. The
consumer folds its contribution for those rows into `chunk.acc` in place. When the stream is
exhausted, `out` holds, for this rank's own rows, the accumulators combined over all ranks (a sum
for gradients, a log-add-exp for log-sum-exp statistics). Every rank must drain the stream: it
runs collectives.

RingExchange (the default): chunks travel around the ring r -> r+1. A chunk's payload is sent on
*before* the consumer works on it, so the transfer overlaps the tile compute (the neighbour
exchange of SigLIP, at chunk granularity); its accumulator follows one hop behind and, after
world_size hops, lands back at its owner. Live buffers: 2 payload chunks and 3 accumulator chunks,
whatever the world size. Cost: ceil(local_batch / chunk) * world_size point-to-point steps.

AllGatherExchange: all-gathers the payloads and accumulates into a [world, local_batch, width]
buffer delivered by one reduce-scatter (sum) or all-to-all (log-sum-exp). Fewer, larger
collectives, but O(global_batch x dim) memory: kept as the measured alternative
(benchmarks/loss_memory.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from bigclip.ops.loss.collectives import all_gather_single, reduce_scatter_single


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world_size) in `group`; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def chunk_slices(n: int, size: int) -> list[slice]:
    """Consecutive row ranges of at most `size` rows covering range(n)."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def combine_(into: torch.Tensor, other: torch.Tensor, reduce: str) -> None:
    """into <- into (+) other, for the stream's reduction."""
    if reduce == "sum":
        into.add_(other)
    else:
        torch.logaddexp(into, other, out=into)


def _identity(reduce: str) -> float:
    return 0.0 if reduce == "sum" else -math.inf


@dataclass
class Chunk:
    """Rows `rows` of rank `owner`'s payload, with accumulators for those rows."""

    owner: int
    rows: slice
    payload: tuple[torch.Tensor, ...]
    acc: tuple[torch.Tensor, ...]


class Exchange(Protocol):
    def stream(
        self,
        payload: tuple[torch.Tensor, ...],
        *,
        chunk: int,
        acc_widths: tuple[int, ...],
        reduce: str,
        out: tuple[torch.Tensor, ...],
    ) -> Iterator[Chunk]: ...


def _new_acc(rows: int, widths: tuple[int, ...], reduce: str, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.full((rows, w), _identity(reduce), dtype=torch.float32, device=like.device) for w in widths
    )


class _GroupMember:
    """This rank's place in the exchange's process group."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return world_of(self.group)[0]

    @property
    def world(self) -> int:  # looked up per call: the loss may be built before the group exists
        return world_of(self.group)[1]


class RingExchange(_GroupMember):
    """Chunks circulate r -> r+1; accumulators follow one hop behind and return to their owner."""

    def stream(
        self,
        payload: tuple[torch.Tensor, ...],
        *,
        chunk: int,
        acc_widths: tuple[int, ...],
        reduce: str,
        out: tuple[torch.Tensor, ...],
    ) -> Iterator[Chunk]:
        steps = [
            (rows, hop) for rows in chunk_slices(payload[0].shape[0], chunk) for hop in range(self.world)
        ]
        held = tuple(p[steps[0][0]] for p in payload)
        finished: tuple[slice, tuple[torch.Tensor, ...]] | None = None  # accumulator to pass on
        for i, (rows, hop) in enumerate(steps):
            ops, incoming = self._pass_acc(finished)
            held_next = self._next_payload(payload, held, steps[i + 1 :], hop, ops)
            works = _start(ops)
            acc = _new_acc(rows.stop - rows.start, acc_widths, reduce, payload[0])
            yield Chunk(owner=(self.rank - hop) % self.world, rows=rows, payload=held, acc=acc)
            _finish(works)
            if incoming and hop == 0:  # the total for our own previous chunk is home
                _write(out, finished[0], incoming)
            elif incoming:
                for a, b in zip(acc, incoming):
                    combine_(a, b, reduce)
            finished, held, incoming = (rows, acc), held_next, ()  # drop buffers as soon as done
            if self.world == 1:
                _write(out, rows, acc)
                finished = None
        self._deliver_last(finished, out)

    def _peers(self) -> tuple[int, int]:
        return (self.rank + 1) % self.world, (self.rank - 1) % self.world

    def _p2p(self, send: tuple[torch.Tensor, ...], recv: tuple[torch.Tensor, ...], tag0: int) -> list:
        # The same op order on every rank keeps NCCL's in-order matching right; gloo matches by tag.
        right, left = self._peers()
        ops = [
            dist.P2POp(dist.isend, t.contiguous(), group=self.group, group_peer=right, tag=tag0 + k)
            for k, t in enumerate(send)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, group=self.group, group_peer=left, tag=tag0 + k)
            for k, t in enumerate(recv)
        ]
        return ops

    def _pass_acc(
        self, finished: tuple[slice, tuple[torch.Tensor, ...]] | None
    ) -> tuple[list, tuple[torch.Tensor, ...]]:
        """Send the accumulator finished last step to the right; receive its successor from the left."""
        if finished is None or not finished[1]:
            return [], ()
        incoming = tuple(torch.empty_like(a) for a in finished[1])
        return self._p2p(finished[1], incoming, tag0=0), incoming

    def _next_payload(
        self,
        payload: tuple[torch.Tensor, ...],
        held: tuple[torch.Tensor, ...],
        rest: list[tuple[slice, int]],
        hop: int,
        ops: list,
    ) -> tuple[torch.Tensor, ...]:
        """The payload for the next step: from the left neighbour mid-ring, else our own next chunk."""
        if not rest:
            return ()
        if hop < self.world - 1:
            nxt = tuple(torch.empty_like(t) for t in held)
            ops += self._p2p(held, nxt, tag0=len(ops))
            return nxt
        return tuple(p[rest[0][0]] for p in payload)

    def _deliver_last(self, finished: tuple[slice, tuple[torch.Tensor, ...]] | None, out: tuple) -> None:
        ops, incoming = self._pass_acc(finished)
        _finish(_start(ops))
        if incoming:
            _write(out, finished[0], incoming)


def _start(ops: list) -> list:
    works = dist.batch_isend_irecv(ops) if ops else []
    ops.clear()
    return works


def _finish(works: list) -> None:
    # Work objects keep their tensors alive (gloo, NCCL): release them as soon as they are done.
    for work in works:
        work.wait()
    works.clear()


def _write(out: tuple[torch.Tensor, ...], rows: slice, values: tuple[torch.Tensor, ...]) -> None:
    for o, v in zip(out, values):
        o[rows] = v


class AllGatherExchange(_GroupMember):
    """All-gather every payload; deliver accumulators with one reduce-scatter or all-to-all."""

    def stream(
        self,
        payload: tuple[torch.Tensor, ...],
        *,
        chunk: int,
        acc_widths: tuple[int, ...],
        reduce: str,
        out: tuple[torch.Tensor, ...],
    ) -> Iterator[Chunk]:
        gathered = [self._gather(p) for p in payload]
        n = payload[0].shape[0]
        accs = [a.view(self.world, n, -1) for a in _new_acc(self.world * n, acc_widths, reduce, payload[0])]
        for owner in range(self.world):
            for rows in chunk_slices(n, chunk):
                yield Chunk(
                    owner=owner,
                    rows=rows,
                    payload=tuple(g[owner, rows] for g in gathered),
                    acc=tuple(a[owner, rows] for a in accs),
                )
        del gathered
        for acc, target in zip(accs, out):
            self._deliver(acc, target, reduce)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x.unsqueeze(0)
        # Concatenated along rows, then viewed per rank: gloo takes no stacked output.
        gathered = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        all_gather_single(gathered, x.contiguous(), group=self.group)
        return gathered.view(self.world, *x.shape)

    def _deliver(self, acc: torch.Tensor, out: torch.Tensor, reduce: str) -> None:
        if self.world == 1:
            out.copy_(acc[0])
        elif reduce == "sum":
            reduce_scatter_single(out, acc.flatten(0, 1), group=self.group)
        else:
            received = torch.empty_like(acc)
            dist.all_to_all_single(received.flatten(0, 1), acc.flatten(0, 1), group=self.group)
            torch.logsumexp(received, dim=0, out=out)


EXCHANGES: dict[str, type] = {"ring": RingExchange, "allgather": AllGatherExchange}
