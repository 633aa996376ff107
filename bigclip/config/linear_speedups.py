"""Which linears a low-precision kind converts: measured speed-ups over bf16 per shape, per kind and
GPU family, and the filter that reads them (torchao.float8's `module_filter_fn` is the model).

A kind is worth it only where its GEMMs gain more than its casts and scales cost, and on Hopper
that is the large shapes only: fp8 over every ViT-bigG-14 linear ran 0.83x of bf16's step, and
SwitchBack per layer 0.37-1.05x (docs/benchmarks.md). So `linear_filter` converts a linear of K
inputs and N outputs that sees M rows per micro-batch only where the table holds a shape at most
as large in all three (K' <= K, N' <= N, M' <= M) measured faster than bf16: a GEMM's gain from
low precision grows with each of its sizes, so a shape that dominates a faster one is taken to be
faster too, and nothing beyond what was measured is assumed. Each row names its source.

`--linear-filter auto` reads the table of the GPU the run computes on. Where the table has no row
for a kind on a family (a CPU, where the kinds run for their numerics, or a GPU family nobody has
measured), every linear the kind takes is converted, and the run's log line says so;
`--linear-filter all` converts every one anywhere, and `--linear-filter hopper` (any family) reads
that family's rows on any machine: a CPU rehearses what an H100 run will convert. Plain numbers,
no torch: flags are checked without it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """One linear shape timed forward + backward against bf16 on one GPU family."""

    in_features: int  # K
    out_features: int  # N
    tokens: int  # M: rows of the input (micro-batch x sequence)
    speedup: float  # bf16's time / the kind's
    source: str

    @property
    def shape(self) -> str:
        return f"{self.in_features}->{self.out_features} at {self.tokens} tokens"


@dataclass(frozen=True)
class Decision:
    convert: bool
    reason: str  # for the run's log line, e.g. "8192->16384 at 4096 tokens measured 1.39x"


# GPU families by CUDA compute capability (major, minor).
FAMILIES = {(8, 0): "ampere", (8, 6): "ampere", (8, 7): "ampere", (8, 9): "ada", (9, 0): "hopper",
            (10, 0): "blackwell", (12, 0): "blackwell"}  # fmt: skip
FILTERS = ("auto", "all", *sorted(set(FAMILIES.values())))  # --linear-filter's values

_SWITCHBACK_H100 = "benchmarks/results/switchback_layers_gpu.json (H100 80GB, torch 2.11)"
_TORCHAO_H100 = "torchao.float8's README, H100 forward + backward"


def _rows(source: str, *rows: tuple[int, int, int, float]) -> tuple[Measured, ...]:
    return tuple(Measured(k, n, m, s, source) for k, n, m, s in rows)


# (kind, family) -> measured (K, N, M, speed-up). Only kinds and families with rows are filtered.
SPEEDUPS: dict[tuple[str, str], tuple[Measured, ...]] = {
    ("switchback-global", "hopper"): _rows(
        _SWITCHBACK_H100,
        (1664, 8192, 16384, 0.688), (1664, 8192, 65536, 0.941), (8192, 1664, 16384, 0.559),
        (8192, 1664, 65536, 0.988), (1280, 5120, 16384, 0.393), (1280, 5120, 65536, 0.755),
        (5120, 1280, 16384, 0.371), (5120, 1280, 65536, 0.802),
    ),
    ("switchback-vectorwise", "hopper"): _rows(
        _SWITCHBACK_H100,
        (1664, 8192, 16384, 0.857), (1664, 8192, 65536, 1.023), (8192, 1664, 16384, 0.729),
        (8192, 1664, 65536, 1.052), (1280, 5120, 16384, 0.471), (1280, 5120, 65536, 0.862),
        (5120, 1280, 16384, 0.423), (5120, 1280, 65536, 0.923),
    ),
    ("switchback-memefficient", "hopper"): _rows(
        _SWITCHBACK_H100,
        (1664, 8192, 16384, 0.756), (1664, 8192, 65536, 0.966), (8192, 1664, 16384, 0.592),
        (8192, 1664, 65536, 0.942), (1280, 5120, 16384, 0.409), (1280, 5120, 65536, 0.791),
        (5120, 1280, 16384, 0.360), (5120, 1280, 65536, 0.763),
    ),
    ("fp8-tensorwise", "hopper"): _rows(_TORCHAO_H100, (2048, 1024, 1024, 0.80), (8192, 16384, 4096, 1.39)),
    ("fp8-rowwise", "hopper"): _rows(
        _TORCHAO_H100, (2048, 8192, 16384, 1.05), (8192, 2048, 16384, 0.87), (8192, 8192, 16384, 1.30)
    ),
}  # fmt: skip


def device_family(device_type: str, capability: tuple[int, int] | None = None) -> str:
    """The family a device is: "cpu", a GPU family of FAMILIES, or "unknown" (an unlisted GPU)."""
    if device_type != "cuda":
        return device_type
    return FAMILIES.get(tuple(capability or ()), "unknown")


def linear_filter(kind: str, family: str, in_features: int, out_features: int, tokens: int) -> Decision:
    """Whether `kind` converts a linear of this shape on `family` ("all": every linear), and why."""
    rows = SPEEDUPS.get((kind, family))
    if rows is None:
        why = {"all": "--linear-filter all", "cpu": "a CPU runs the kinds for their numerics, not speed"}
        return Decision(
            True, f"every linear: {why.get(family, f'no measured shapes for {kind} on {family} GPUs')}"
        )
    faster = [r for r in rows if r.speedup > 1.0 and r.in_features <= in_features
              and r.out_features <= out_features and r.tokens <= tokens]  # fmt: skip
    if faster:
        best = max(faster, key=lambda r: r.speedup)
        return Decision(True, f"{best.shape} measured {best.speedup:.2f}x")
    return Decision(False, f"no shape at most this large measured faster than bf16 on {family}")
