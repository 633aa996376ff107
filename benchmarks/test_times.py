"""Time each test tier on a fresh clone: writes benchmarks/results/test_times.json.

    python benchmarks/test_times.py            # clone this checkout, then `make test` and `make test-fast`

`make test` runs first and its time includes the set-up of every environment (.venv, .venv-ref,
.venv-low); `make test-fast` then reuses that .venv, so its time is the tier's own. docs/testing.md
renders the table (benchmarks/render_docs.py). Takes as long as the tiers: about an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import git_commit, print_table, write_results  # noqa: E402

# pytest's last line: "1558 passed, 3 skipped in 1500.12s (0:25:00)"
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*) in ([\d.]+)s")
# a --durations line: "128.41s call     tests/test_zeroshot.py::test_demo_recipe"
DURATION = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+\S+")


def slowest_by_stack(output: str, stacks: list[str]) -> dict[str, list[str]]:
    """Each pytest run's --durations lines (printed before its summary line), by stack."""
    slowest: dict[str, list[str]] = {}
    lines: list[str] = []
    runs = iter(stacks)
    for line in map(str.strip, output.splitlines()):
        if DURATION.match(line):
            lines.append(line)
        elif SUMMARY.match(line):
            slowest[next(runs, "?")], lines = lines, []
    return slowest


def timed_make(clone: Path, tier: str, stacks: list[str], log_dir: Path) -> dict:
    """`make TIER` in the clone, as CI runs it; `stacks` names the pytest runs it makes, in order.
    Its whole output goes to LOG_DIR/TIER.log: a red test's message (a job's log) is there."""
    start = time.monotonic()
    env = {**os.environ, "CI": "true"}  # as CI runs it: a missing reference fails instead of skipping
    done = subprocess.run(["make", tier], cwd=clone, env=env, capture_output=True, text=True)
    seconds = round(time.monotonic() - start)
    log = log_dir / f"{tier}.log"
    log.write_text(done.stdout + done.stderr)
    print(f"make {tier}: {seconds} s, exit {done.returncode}; its output: {log}", flush=True)
    runs = [m for m in map(SUMMARY.match, done.stdout.splitlines()) if m]
    if len(runs) != len(stacks):  # a run that died before its summary: keep its output's tail
        print(done.stdout[-4000:], done.stderr[-4000:], file=sys.stderr)
    pytest_s = {stack: round(float(m.group(2))) for stack, m in zip(stacks, runs)}
    summary = "; ".join(f"{stack}: {m.group(1)}" for stack, m in zip(stacks, runs))
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    slowest = slowest_by_stack(done.stdout, stacks)
    return {
        "tier": tier,
        "seconds": seconds,
        "exit": done.returncode,
        "pytest_s": pytest_s,
        "summary": summary,
        "failures": failures,
        # each stack's --durations lines: where the next cut is, and the order tests/conftest.py
        # hands the files out in (the most expensive first, so none is left to run alone at the end)
        "slowest": slowest,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "bigclip-test-times",
                        help="where each tier's whole output is kept (default: %(default)s)")  # fmt: skip
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    commit = git_commit()  # what the clone holds, whatever is committed while it runs
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "bigclip"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        rows = [
            {**timed_make(clone, "test", ["main", "low"], args.log_dir), "set_up": "included"},
            {
                **timed_make(clone, "test-fast", ["main"], args.log_dir),
                "set_up": "excluded (make test's .venv)",
            },
        ]
    print_table(rows, ["tier", "seconds", "exit", "pytest_s", "set_up", "summary"])
    write_results("test_times", rows, commit=commit)
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
