"""One compact Markdown table per benchmarks/results/NAME.json, for docs/ (render_docs.py puts them
there). Each table shows the ratios the benchmark exists for, then one line saying when, at which
commit and on what it was measured, so a reader can tell how old a figure is.

A benchmark without a table of its own here is shown by `generic` (its rows' scalar columns).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import faults_report, scale_sim_report

Json = dict[str, Any]


def table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def cell(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    return "-" if value is None else str(value)


def x(value: float) -> str:
    """A ratio, as `2.14x`."""
    return f"{value:.2f}x"


def provenance(data: Json, command: str) -> str:
    date = str(data.get("date", "?"))[:10]
    torch = f" (torch {data['torch']})" if data.get("torch") else ""
    return f"_Measured {date} at commit {data.get('commit', '?')} on {data.get('device', '?')}{torch}: {command}._"


def loss_memory(d: Json) -> str:
    rows = [
        [r["global"], r["method"], f"{r['peak_MiB']:,.1f}", x(r["mem_saving_x"]), x(r["time_ratio"])]
        for r in d["rows"]
    ]
    head = ["global batch", "loss", "peak MiB (rank 0)", "memory saved", "time vs unchunked"]
    return table(head, rows)


def loss_time_gloo(d: Json) -> str:
    rows = [[r["global"], r["method"], f"{r['seconds']:.3f}", x(r["time_ratio"])] for r in d["rows"]]
    return table(["global batch", "loss", "seconds (slowest rank)", "time vs unchunked"], rows)


def engines(d: Json) -> str:
    rows = [
        [r["engine"], r["optimizer"], r["precision"], f"{r['model_state_MB_per_rank']:,.0f}",
         f"{r['optimizer_state_MB_per_rank']:,.0f}", x(r["memory_vs_fsdp"]), x(r["time_vs_fsdp"])]
        for r in d["rows"]
    ]  # fmt: skip
    head = ["engine", "optimizer", "precision", "model state MB/rank", "optimizer state MB/rank",
            "memory vs FSDP2", "step time vs FSDP2"]  # fmt: skip
    return table(head, rows)


def optimizer_step(d: Json) -> str:
    rows = [
        [r["optimizer"], f"{r['step_ms']:.0f}", x(r["step_vs_fused"]), f"{r['bytes_per_param']:.1f}",
         f"{r['max_param_diff_rel']:.0e}", "-" if r.get("build_s") is None else f"{r['build_s']:.0f}"]
        for r in d["rows"]
    ]  # fmt: skip
    head = ["optimizer", "step ms", "time vs fused", "first-step growth, bytes/param",
            "parameters vs foreach (relative)", "build s"]  # fmt: skip
    return table(head, rows)


def host_overhead(d: Json) -> str:
    """Host ms and aten operators per step, each against the baseline commit's row of its kind."""
    rows = [
        [r["row"], r["code"], f"{r['host_ms']:.0f}", x(r["host_vs_baseline"]),
         "-" if r["aten_ops"] is None else f"{r['aten_ops']:,}",
         "-" if r["ops_vs_baseline"] is None else x(r["ops_vs_baseline"])]
        for r in d["rows"]
    ]  # fmt: skip
    head = ["step", "code", "host ms", "vs baseline", "aten ops", "vs baseline"]
    return table(head, rows)


def switchback(d: Json) -> str:
    """Speed against bf16 per linear shape and token count, a column per SwitchBack variant."""
    variants = list(dict.fromkeys(r["variant"] for r in d["rows"]))
    cases: dict[tuple[str, int], dict[str, float]] = {}
    for r in d["rows"]:
        cases.setdefault((r["shape"], r["tokens"]), {})[r["variant"]] = r["speedup"]
    rows = [
        [shape, tokens, *(x(v[k]) if k in v else "-" for k in variants)]
        for (shape, tokens), v in cases.items()
    ]
    return table(["linear", "tokens", *variants], rows)


def checkpoint_io(d: Json) -> str:
    rows = [
        [r["phase"].strip(), r["method"], f"{r['seconds']:.2f}", r.get("server CPU s")] for r in d["rows"]
    ]
    ratios = (
        f"Save until committed {x(d['save_speedup_vs_baseline'])} the baseline's speed, load"
        f" {x(d['load_speedup_vs_baseline'])}, async save blocks training for"
        f" {d['async_blocked_fraction_of_sync_save']:.1%} of a synchronous save; {d['total_gb']:.2f} GB"
        f" over {d['ranks']} ranks, endpoint: {d['endpoint']}."
    )
    return ratios + "\n\n" + table(["phase", "method", "seconds", "server CPU s"], rows)


def consolidate(d: Json) -> str:
    rows = [
        [r["checkpoint"], r["tool"], f"{r['peak_rss_gb']:.2f}", x(r["rss_vs_bigclip"]) if r.get("rss_vs_bigclip") else "-",
         f"{r['seconds']:.1f}", _same_bytes(r), r.get("checksums_while_reading")]
        for r in d["rows"]
    ]  # fmt: skip
    head = ["checkpoint", "tool", "peak RSS GB", "RSS vs bigclip", "seconds", "same bytes", "checksums read"]
    notes = [f"{r['tool']}: peak is {r['peak_is']} (rank {r['rank_rss_before_gb']:.2f} GB before it; the same"
             f" save without consolidation peaks at {r['sharded_save']['peak_rss_gb']:.2f} GB)."
             for r in d["rows"] if r.get("peak_is")]  # fmt: skip
    dates = {r["date"][:10] + " at " + r["commit"] for r in d["rows"] if r.get("date")}
    if len(dates) > 1:  # rows merged from runs at different dates (`--only`)
        notes.append("Rows measured " + ", ".join(sorted(dates)) + " (see each row's `date` and `commit`).")
    return table(head, rows) + "".join(f"\n\n{n}" for n in notes)


def _same_bytes(r: Json) -> str:
    if r["identical"] or not r.get("differing"):
        return cell(r["identical"])

    def why(value: Any) -> str:
        if isinstance(value, dict):  # both values of a small tensor
            return ", ".join(
                f"{tool} {v:.4g}" if isinstance(v, float) else f"{tool} {v}" for tool, v in value.items()
            )
        return str(value)

    return "no: " + "; ".join(f"{name} ({why(value)})" for name, value in r["differing"].items())


def data_loader(d: Json) -> str:
    rows = []
    for r in d["rows"]:
        value = r.get("value")
        if isinstance(value, dict):  # PSNR: mean and min
            value = " / ".join(f"{v:.1f}" for v in value.values())
        elif "speed-up" in r:  # seconds to the first batch, both ways
            value = f"{value[0]:.2f} s vs {value[1]:.2f} s ({x(r['speed-up'])})"
        elif "cpu ms/sample" in r:
            value = f"{r['cpu ms/sample']:.2f} CPU ms/sample, {r['samples/s']:.0f} samples/s"
        rows.append([r["set"], r["measure"], value])
    return table(["images", "measure", "value"], rows)


def tokenizer(d: Json) -> str:
    rows = [
        [r["captions"], f"{r['open_clip_us']:.0f}", f"{r['bigclip_us']:.0f}", x(r["speedup"])]
        for r in d["rows"]
    ]
    return table(["captions", "OpenCLIP µs/caption", "bigclip µs/caption", "speed-up"], rows)


def remote_sync(d: Json) -> str:
    rows = []
    for r in d["rows"]:
        if "mirror/upload_file" in r:
            rows.append(
                [
                    f"{r['case']}: mirror vs boto3 upload_file, time",
                    "-",
                    r["size_MB"],
                    "-",
                    x(r["mirror/upload_file"]),
                ]
            )
            continue
        rows.append(
            [
                r["case"],
                r.get("step"),
                r.get("size_MB"),
                r.get("uploaded/size"),
                r.get("commit_to_remote_commit_s"),
            ]
        )
    return table(["case", "step", "checkpoint MB", "uploaded / size", "s from local to remote commit"], rows)


def precision_vs_autocast(d: Json) -> str:
    rows = [
        [r["model"], r["variant"], r["grad_rel_err_vs_fp32"], r["grad_rel_err_vs_autocast"]]
        for r in d["rows"]
    ]
    return table(["model", "variant", "gradient error vs fp32", "vs OpenCLIP's autocast"], rows)


def normalize_cpu(d: Json) -> str:
    rows = [
        [r["dtype"], r["variant"], f"{r['cpu_ms']:.0f}", x(r["cpu_vs_after"]), r["bitwise_equal"]]
        for r in d["rows"]
    ]
    return table(["dtype", "path", "CPU ms per batch", "CPU vs new path", "bitwise equal"], rows)


def loss_exchange_link(d: Json) -> str:
    """Ring against all-gather per link rate."""
    by_rate: dict[str, dict[str, float]] = {}
    for r in d["rows"]:
        by_rate.setdefault(r["rate"], {})[r["method"]] = r["seconds"]
    rows = [
        [rate, f"{t['ring']:.2f}", f"{t['allgather']:.2f}", x(t["ring"] / t["allgather"])]
        for rate, t in by_rate.items()
    ]
    return table(["link rate", "ring s", "all-gather s", "ring / all-gather"], rows)


def plan_vs_measured_cpu(d: Json) -> str:
    rows = [
        [
            r["rate"],
            r["method"],
            f"{r['bytes_ratio']:.3f}",
            r.get("time_ratio"),
            r.get("nominal_ratio"),
            r["verdict"],
        ]
        for r in d["rows"]
    ]
    head = ["link", "exchange", "bytes vs plan", "time vs plan", "time vs tbf's nominal rate", "verdict"]
    return table(head, rows)


def faults(d: Json) -> str:
    return faults_report.markdown(d["rows"])  # the table faults.py prints


def demo_data_learnability(d: Json) -> str:
    rows = [
        [r["when"], r["steps"], f"{r['i2t_top1']:.1%}", f"{r['t2i_top1']:.1%}", f"{r['chance']:.1%}"]
        for r in d["rows"]
    ]
    return table(["", "steps", "image -> text top-1", "text -> image top-1", "chance"], rows)


def demo_seed_spread(d: Json) -> str:
    """What `make demo` printed at its default seed (0), then each figure's range over the seeds run."""
    from bigclip.demo.report import DemoSummary, spread_table, summary_lines

    runs = [DemoSummary.from_dict(s) for s in d["summaries"]]
    default = next(s for s in runs if s.seed == 0)
    seeds = ", ".join(str(s.seed) for s in runs)
    chance = 1 / default.pairs
    seed0 = next(r for r in d["rows"] if r["seed"] == 0)
    cpu_min, wall_min = seed0["cpu_s"] / 60, seed0["wall_s"] / 60
    return "\n".join([
        "```", *summary_lines(default), "```", "",
        f"The figures vary with the seed (`bigclip demo --seed S`; `make demo` runs seed 0), measured over "
        f"{len(runs)} seeds ({seeds}), each a whole demo run:", "",
        table(["figure", "seed 0", f"range over {len(runs)} seeds", "±"], spread_table(runs)), "",
        f"Held-out retrieval at seed 0 is {default.image_to_text / chance:.0f}x / {default.text_to_image / chance:.0f}x "
        f"chance ({100 * chance:.2f}% over {default.pairs} pairs). A whole demo run (both phases, "
        f"after set-up) used {cpu_min:.0f} CPU-minutes at seed 0, {wall_min:.0f} minutes of wall time on "
        f"{d['device']}.",
    ])  # fmt: skip


def test_times(d: Json) -> str:
    def stacks(r: Json) -> str:
        return ", ".join(f"{stack} {s / 60:.1f}" for stack, s in r.get("pytest_s", {}).items())

    rows = [
        [
            f"`make {r['tier']}`",
            f"{r['seconds'] / 60:.1f}",
            stacks(r),
            r.get("set_up", ""),
            r.get("summary", ""),
        ]
        for r in d["rows"]
    ]
    return table(["tier", "minutes", "pytest per stack (min)", "set-up", "tests"], rows)


def step_variants(d: Json) -> str:
    """One model's step per variant: speed, memory, MFU, speed-ups; with --profile, the share of
    the step the GPU was busy (the rest is time the GPU waited for the host)."""
    head = ["variant", "engine", "step s", "samples/s", "peak GiB", "MFU (datasheet)", "vs OpenCLIP",
            "vs best bf16", "GPU busy"]  # fmt: skip
    rows = [
        [
            r["variant"],
            r.get("engine"),
            f"{r['step_s']:.3f}" if "step_s" in r else r.get("error", "-"),
            r.get("samples_per_s"),
            r.get("peak_GiB"),
            f"{r['mfu_vs_datasheet_peak']:.1%}" if "mfu_vs_datasheet_peak" in r else "-",
            x(r["speedup_vs_openclip"]) if "speedup_vs_openclip" in r else "-",
            x(r["speedup_vs_best_bf16"]) if "speedup_vs_best_bf16" in r else "-",
            f"{r['gpu_busy_ms'] / 1e3 / r['step_s']:.0%}" if "gpu_busy_ms" in r else "-",
        ]
        for r in d["rows"]
    ]
    return (
        table(head, rows)
        + f"\n\n{d.get('model', '')}, batch {d.get('batch', '?')}, median of {d.get('steps', '?')} steps."
    )


def generic(d: Json) -> str:
    """Any other results file: the scalar columns of its first rows."""
    rows = d.get("rows") or []
    if not rows or not isinstance(rows[0], dict):
        return "(no rows)"
    head = [k for k, v in rows[0].items() if not isinstance(v, (dict, list))][:8]
    return table(head, [[r.get(k) for k in head] for r in rows[:20]])


TABLES: dict[str, Callable[[Json], str]] = {
    f.__name__: f
    for f in (
        loss_memory, loss_time_gloo, engines, optimizer_step, switchback, checkpoint_io, consolidate,
        data_loader, tokenizer, remote_sync, precision_vs_autocast, normalize_cpu, loss_exchange_link,
        plan_vs_measured_cpu, faults, demo_data_learnability, demo_seed_spread, test_times, host_overhead,
    )
}  # fmt: skip
TABLES["checkpoint_io_s3rver"] = checkpoint_io
TABLES["scale_sim"] = scale_sim_report.markdown
TABLES["switchback_layers_gpu"] = switchback
TABLES["step_variants_ViT_bigG_14_fsdp_gpu"] = step_variants
TABLES["step_variants_ViT_bigG_14_fsdp_profile_gpu"] = step_variants

HOW = {  # how each result is made, where that is not `python benchmarks/NAME.py`
    "checkpoint_io_s3rver": "`python benchmarks/checkpoint_io.py --endpoint http://127.0.0.1:4569 --server-pid PID`",
    "plan_vs_measured_cpu": "`python benchmarks/plan_vs_measured.py --link` (root)",
    "faults": "`python benchmarks/faults.py` (root, a real Slurm)",
    "loss_exchange_link": "`python benchmarks/loss_exchange_link.py` (root)",
    "step_variants_ViT_bigG_14_fsdp_gpu": "`python benchmarks/step_variants_gpu.py --steps 4 --variants "
    "openclip:full bigclip:ops fp8-tensorwise:ops`",
    "step_variants_ViT_bigG_14_fsdp_profile_gpu": "`python benchmarks/step_variants_gpu.py --steps 4 --profile "
    "--name step_variants_ViT_bigG_14_fsdp_profile --variants bigclip:ops fp8-tensorwise:ops fp8-rowwise:ops`",
    "switchback_layers_gpu": "`python benchmarks/switchback.py --quick --no-e2e`",
    "test_times": "each tier timed on a fresh clone (`python benchmarks/test_times.py` repeats it)",
}


def how(name: str) -> str:
    """How results/NAME.json is made, as Markdown."""
    if name in HOW:
        return HOW[name]
    if name.endswith("_gpu"):
        return "`make bench-gpu` on a GPU node"
    return f"`python benchmarks/{name}.py`"


def render(name: str, results: Path) -> str:
    """The table of results/NAME.json with its provenance, or a line saying it is not yet measured."""
    path = results / f"{name}.json"
    if not path.exists():
        return f"Not yet measured (`benchmarks/results/{name}.json` is written by {how(name)})."
    data = json.loads(path.read_text())
    return TABLES.get(name, generic)(data) + "\n\n" + provenance(data, how(name))
