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


def timed_make(clone: Path, tier: str, stacks: list[str]) -> dict:
    """`make TIER` in the clone, as CI runs it; `stacks` names the pytest runs it makes, in order."""
    start = time.monotonic()
    env = {**os.environ, "CI": "true"}  # as CI runs it: a missing reference fails instead of skipping
    done = subprocess.run(["make", tier], cwd=clone, env=env, capture_output=True, text=True)
    seconds = round(time.monotonic() - start)
    runs = [m for m in map(SUMMARY.match, done.stdout.splitlines()) if m]
    if len(runs) != len(stacks):  # a run that died before its summary: keep its output's tail
        print(done.stdout[-4000:], done.stderr[-4000:], file=sys.stderr)
    pytest_s = {stack: round(float(m.group(2))) for stack, m in zip(stacks, runs)}
    summary = "; ".join(f"{stack}: {m.group(1)}" for stack, m in zip(stacks, runs))
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    slowest = [line.strip() for line in done.stdout.splitlines() if DURATION.match(line.strip())]
    return {
        "tier": tier,
        "seconds": seconds,
        "exit": done.returncode,
        "pytest_s": pytest_s,
        "summary": summary,
        "failures": failures,
        "slowest": slowest,  # each stack's --durations lines: where the next cut is
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    commit = git_commit()  # what the clone holds, whatever is committed while it runs
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "bigclip"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        rows = [
            {**timed_make(clone, "test", ["main", "low"]), "set_up": "included"},
            {**timed_make(clone, "test-fast", ["main"]), "set_up": "excluded (make test's .venv)"},
        ]
    print_table(rows, ["tier", "seconds", "exit", "pytest_s", "set_up", "summary"])
    write_results("test_times", rows, commit=commit)
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
