"""Bytes the chunked loss's exchange sends per step, and their time over a link of given bandwidth.

The model is NCCL's "bus bandwidth" one: each collective runs as a ring, so a rank's time is the
bytes it sends to its ring neighbour over the slowest hop a ring crosses (`--link-gbps`: between
nodes, a GPU's share of the node's network; between two hosts, their link). Per loss call, with
n local rows, W ranks, d the embed dim, a bytes per feature element and fp32 (4-byte) statistics
and accumulators (bigclip/ops/loss/chunked.py, exchange.py):
  ring, CLIP    forward: text chunks travel W-1 hops, their log-sum-exp accumulators W hops:
                    (W-1) n d a + 4 W n
                backward: text chunks with 2 statistics per row W-1 hops, gradient accumulators
                (d + 1 floats per row) W hops:  (W-1) n (d a + 8) + 4 W n (d + 1)
  ring, SigLIP  forward (W-1) n d a; backward (W-1) n d a + 4 W n d
  allgather     an all-gather sends (W-1)/W of its output per rank; a reduce-scatter (W-1)/W of its
                input on NCCL's ring, 2 (W-1)/W on gloo, which runs it as an all-reduce (measured by
                benchmarks/plan_vs_measured.py --link); CLIP's log-sum-exps take one all-to-all
                of 4 (W-1) n bytes. CLIP: gathers of n d a (forward) and n (d a + 8) (backward),
                a reduce-scatter of W n (d + 1) floats; SigLIP: gathers of n d a twice and a
                reduce-scatter of W n d floats.
With --accum-freq K the loss runs K times per step, each over the K x b cached rows. The ring
sends each chunk before its tiles are computed, so on GPUs this time overlaps compute; the
all-gather's collectives do not. Not priced: OpenCLIP's unchunked loss (--loss-chunk-size 0), and
latency (the ring takes ceil(n / chunk) x W hops per pass, each paying one). Checked against a
tc-limited link between two network namespaces by benchmarks/plan_vs_measured.py --link.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.errors import ConfigError
from bigclip.plan.spec import PlanSpec, dtype_bytes

FP32 = 4
REDUCE_SCATTER_PASSES = {"nccl": 1, "gloo": 2}  # gloo's reduce-scatter is an all-reduce


@dataclass(frozen=True)
class ExchangeShape:
    """One chunked-loss call: `kind` clip | siglip, `exchange` ring | allgather, on `world` ranks."""

    kind: str
    exchange: str
    local: int  # rows per rank
    world: int
    dim: int
    feature_bytes: int  # 2 for bf16/fp16 features, 4 for fp32
    backend: str = "nccl"


def exchange_bytes(shape: ExchangeShape) -> int:
    """Bytes one rank sends per loss call, forward + backward (module docstring)."""
    if shape.backend not in REDUCE_SCATTER_PASSES:
        raise ConfigError(f"backend {shape.backend!r}: the planner prices {', '.join(REDUCE_SCATTER_PASSES)}")
    if shape.world == 1:
        return 0
    if shape.exchange == "ring":
        return _ring_bytes(shape)
    if shape.exchange == "allgather":
        return _allgather_bytes(shape)
    raise ConfigError(f"loss exchange {shape.exchange!r}: use ring or allgather")


def _ring_bytes(s: ExchangeShape) -> int:
    hops, row = s.world - 1, s.dim * s.feature_bytes
    if s.kind == "siglip":
        return hops * s.local * row * 2 + FP32 * s.world * s.local * s.dim
    forward = hops * s.local * row + FP32 * s.world * s.local
    return forward + hops * s.local * (row + 2 * FP32) + FP32 * s.world * s.local * (s.dim + 1)


def _allgather_bytes(s: ExchangeShape) -> int:
    hops, row = s.world - 1, s.dim * s.feature_bytes
    passes = REDUCE_SCATTER_PASSES[s.backend]
    if s.kind == "siglip":
        return hops * s.local * row * 2 + passes * hops * s.local * s.dim * FP32
    gathers = hops * s.local * row + hops * s.local * (row + 2 * FP32)
    return gathers + FP32 * hops * s.local + passes * hops * s.local * (s.dim + 1) * FP32


def loss_exchange_bytes(spec: PlanSpec) -> int | None:
    """Bytes one rank sends per step for the chunked loss; None for the unchunked loss."""
    if not spec.loss_chunk_size:
        return None
    shape = ExchangeShape(
        kind=spec.loss,
        exchange=spec.loss_exchange,
        local=spec.batch_size * spec.accum_freq,
        world=spec.gpus,
        dim=spec.model_shape().embed_dim,
        feature_bytes=dtype_bytes(spec.dtypes.compute_dtype),
        backend=spec.dist_backend,
    )
    return spec.accum_freq * exchange_bytes(shape)


def transfer_seconds(nbytes: int, *, link_gbps: float) -> float:
    """Time to send `nbytes` over a link of `link_gbps` gigabits per second."""
    if link_gbps <= 0:
        raise ConfigError(f"--link-gbps must be positive, got {link_gbps}")
    return nbytes * 8 / (link_gbps * 1e9)
