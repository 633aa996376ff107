"""The table docs/scale-and-slurm.md shows of benchmarks/results/scale_sim.json: one row per
simulated world, each goal's figure beside the code it replaced ("before", where measured)."""

from __future__ import annotations

from typing import Any

HEAD = [
    "ranks",
    "ZeRO-3 state, rank 0 CPU s per save (before)",
    "commit, rank 0 CPU s: first / later save (DCP's coordinator)",
    ".metadata MB",
    "resume reads per rank, MB (before)",
    "S3 writes on the busiest prefix per save (before)",
    "shard opens in an epoch's busiest second (before)",
    "lost node: survivors named and requeued, store requests per rank (before)",
    "sockets of rank 0 / another rank (full mesh)",
]


RANK0, OTHERS = "rank 0 sockets", "other ranks' sockets (most)"  # scale_sockets.py's columns
NAMED, REQUESTS = "named and requeued", "requests per rank"  # scale_store.py's


def _by_world(data: dict[str, Any], goal: int, **match: Any) -> dict[int, dict[str, Any]]:
    rows = data.get("goals", {}).get(str(goal), {}).get("rows", [])
    return {r["world"]: r for r in rows if all(r.get(k) == v for k, v in match.items())}


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) and abs(value) >= 10_000 else str(value)


def _beside(new: Any, old: Any) -> str:
    return _num(new) if old is None else f"{_num(new)} ({_num(old)})"


def rows(data: dict[str, Any]) -> list[list[str]]:
    zero3, dcp, s3, opens = (_by_world(data, g) for g in (1, 2, 3, 4))
    hang_new, hang_old = _by_world(data, 5, protocol="new"), _by_world(data, 5, protocol="old")
    lazy, mesh = _by_world(data, 6, gloo="lazy"), _by_world(data, 6, gloo="full mesh")
    out = []
    for world in data.get("worlds", []):
        z, d, s, o = zero3.get(world, {}), dcp.get(world, {}), s3.get(world, {}), opens.get(world, {})
        hn, ho, sl, sm = hang_new.get(world), hang_old.get(world, {}), lazy.get(world), mesh.get(world, {})
        commit = "-"
        if d:
            today = d.get("today_rank0_cpu_s")
            commit = f"{_num(d['first_save_rank0_cpu_s'])} / {_num(d['later_save_rank0_cpu_s'])}"
            commit += f" ({_num(today)})" if today is not None else ""
        hang = "-" if hn is None else f"{hn[NAMED]}, {_beside(hn[REQUESTS], ho.get(REQUESTS))}"
        if hn is not None and ho:
            hang += f"; before: {ho[NAMED]}"
        sockets = (
            "-"
            if sl is None
            else (f"{sl[RANK0]} / {sl[OTHERS]} ({sm.get(RANK0, '-')} / {sm.get(OTHERS, '-')})")
        )
        out.append([
            str(world),
            _beside(z.get("rank 0 CPU s per save"), z.get("old builder CPU s")) if z else "-",
            commit,
            _num(d.get("metadata_MB")) if d else "-",
            _beside(d.get("resume_read_per_rank_MB"), d.get("resume_read_per_rank_MB_today")) if d else "-",
            _beside(s.get("writes on the step folder"), s.get("old: writes on the step folder")) if s else "-",
            _beside(o.get("most opens in one second"), o.get("old: opens in the first second")) if o else "-",
            hang,
            sockets,
        ])  # fmt: skip
    return out


def markdown(data: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + " --- |" * len(HEAD)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(data)]
    seconds = data.get("seconds", {})
    if seconds:
        lines += ["", "Seconds per goal on this run: " + ", ".join(f"{g}: {s:.0f}" for g, s in seconds.items())
                  + f" ({sum(seconds.values()) / 60:.1f} minutes in all)."]  # fmt: skip
    return "\n".join(lines)
