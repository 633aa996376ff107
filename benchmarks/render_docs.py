"""Rewrite the figures in docs/*.md and README.md from their sources, so none is edited by hand.

  PYTHONPATH=$PWD python benchmarks/render_docs.py          # rewrite every region
  PYTHONPATH=$PWD python benchmarks/render_docs.py --check  # exit 1 naming each stale region

A region is the text between `<!-- rendered: NAME -->` and `<!-- /rendered -->`. NAME is one of:
- a results file's name (`loss_memory` for benchmarks/results/loss_memory.json): its table and
  provenance (benchmarks/doc_tables.py), or "not yet measured" while the file does not exist;
- `gpu_results`: every results/*_gpu.json; `unlisted_results`: every other results file that no
  region names (so a new benchmark shows up somewhere before it gets a table of its own);
- `plan_*`: a table of `bigclip plan` for the runbook's run, computed by the planner itself, so
  the runbook and the planner cannot disagree;
- `bad_input_counts`: the bad-input suite's cases per area, as pytest collects them.
tests/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import doc_tables  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REGION = re.compile(r"(<!-- rendered: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /rendered -->)", re.DOTALL)

# The runbook's run (slurm/render_recipes.sh): ViT-bigG-14 at 160 samples per GPU.
BIGG = ["--model", "ViT-bigG-14", "--precision", "amp_bf16", "--local-loss", "--gather-with-grad",
        "--loss-chunk-size", "1024"]  # fmt: skip
ZERO3 = ["--engine", "deepspeed", "--deepspeed-config", "ds_configs/zero3_vit_bigg.json"]
RUN_LENGTH = ["--train-num-samples", "100000000", "--epochs", "390"]  # 39 B samples seen


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def plan(argv: list[str]) -> dict:
    """`bigclip plan --json` in this process (the planner's own command line, a stable surface)."""
    from bigclip.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["plan", "--json", *argv])
    return json.loads(out.getvalue())


def plan_rows(argv: list[str]) -> list[tuple[str, str]]:
    """The planner's own (quantity, value) rows, as `bigclip plan --markdown` prints them."""
    from bigclip.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["plan", "--markdown", *argv])
    cells = [line.strip("| ").split(" | ") for line in out.getvalue().splitlines() if line.startswith("| ")]
    return [(c[0], c[1]) for c in cells[2:]]  # past the header and its rule


def plan_vit_bigg_1024() -> str:
    argv = ["--gpus", "1024", *BIGG, "--batch-size", "160", "--grad-checkpointing", *RUN_LENGTH]
    fsdp, zero3 = plan_rows(argv), dict(plan_rows([*argv, *ZERO3]))
    rows = [[q, v, zero3.get(q, "-")] for q, v in fsdp]
    return doc_tables.table(
        ["quantity", "FSDP2 (`vit_bigg_fsdp_128x8`)", "ZeRO-3 (`vit_bigg_zero3_128x8`)"], rows
    )


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def plan_batch_sweep() -> str:
    rows = []
    for batch, checkpointing in ((160, True), (320, True), (448, True), (160, False)):
        argv = ["--gpus", "1024", *BIGG, "--batch-size", str(batch)]
        p = plan([*argv, "--grad-checkpointing"] if checkpointing else argv)
        mem = p["memory_bytes"]
        rows.append(
            [batch, "full" if checkpointing else "none", gib(mem["activations"]), gib(mem["peak"]), p["fits"]]
        )
    return doc_tables.table(
        ["samples per GPU", "checkpointing", "activations GiB", "peak GiB", "fits 80 GiB"], rows
    )


def plan_checkpointing() -> str:
    settings = {
        "none": [],
        "full (`--grad-checkpointing`)": ["--grad-checkpointing"],
        "one block in 2 (`--grad-checkpointing-every 2`)": [
            "--grad-checkpointing",
            "--grad-checkpointing-every",
            "2",
        ],
        "ops (`--grad-checkpointing-policy ops`)": [
            "--grad-checkpointing",
            "--grad-checkpointing-policy",
            "ops",
        ],
    }
    rows = []
    for label, flags in settings.items():
        p = plan(["--gpus", "8", *BIGG, "--batch-size", "64", *flags])
        recomputed = p["recomputed_flops_per_step"] / p["model_flops_per_step"]
        rows.append([label, gib(p["memory_bytes"]["activations"]), f"+{recomputed:.0%}", p["fits"]])
    return doc_tables.table(["checkpointing", "activations GiB", "recomputed FLOPs", "fits 80 GiB"], rows)


def bad_input_counts() -> str:
    """The bad-input suite's cases per area, as pytest collects them (tests/support/bad_input_counts.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from bad_input_counts import counts

    per_area = counts()
    rows = [[f"`{area}`", n] for area, n in sorted(per_area.items())] + [["total", sum(per_area.values())]]
    return doc_tables.table(["area (tests/test_bad_input_AREA.py)", "cases"], rows)


PLANS: dict[str, Callable[[], str]] = {
    f.__name__: f for f in (plan_vit_bigg_1024, plan_batch_sweep, plan_checkpointing, bad_input_counts)
}


def several(names: list[str]) -> str:
    if not names:
        return "None beyond the sections above."
    return "\n\n".join(f"**{name}**\n\n{doc_tables.render(name, RESULTS)}" for name in names)


def is_result_name(name: str) -> bool:
    """A results file that exists, has a table, or that a GPU row or a benchmark script writes."""
    written_by_script = (ROOT / "benchmarks" / f"{name.removesuffix('_gpu')}.py").exists()
    return name in doc_tables.TABLES or (RESULTS / f"{name}.json").exists() or written_by_script


def render(name: str, named: set[str]) -> str:
    """The body of region NAME; `named` holds every region name of every page."""
    if name in PLANS:
        return PLANS[name]()
    stems = sorted(p.stem for p in RESULTS.glob("*.json"))
    if name == "gpu_results":
        return several([s for s in stems if s.endswith("_gpu") and s not in named])
    if name == "unlisted_results":
        return several([s for s in stems if not s.endswith("_gpu") and s not in named])
    if is_result_name(name):
        return doc_tables.render(name, RESULTS)
    raise SystemExit(f"render_docs: unknown region {name!r}: name a results file, gpu_results, "
                     f"unlisted_results or one of {', '.join(PLANS)}")  # fmt: skip


def rendered_text(text: str, named: set[str], cache: dict[str, str]) -> str:
    def body(m: re.Match) -> str:
        name = m["name"]
        if name not in cache:
            cache[name] = render(name, named)
        return f"{m.group(1)}{cache[name]}\n{m.group(4)}"

    return REGION.sub(body, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="Change nothing; exit 1 if a region is stale.")
    args = p.parse_args(argv)
    texts = {path: path.read_text() for path in doc_files() if path.exists()}
    named = {m["name"] for text in texts.values() for m in REGION.finditer(text)}
    cache: dict[str, str] = {}
    stale = []
    for path, text in texts.items():
        new = rendered_text(text, named, cache)
        if new == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(new)
    verb = "stale (run: PYTHONPATH=$PWD python benchmarks/render_docs.py)" if args.check else "rewritten"
    for path in stale:
        print(f"render_docs: {path}: {verb}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
