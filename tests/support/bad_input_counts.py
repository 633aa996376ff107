"""Count the bad-input suite's cases per area (the README quotes these numbers).

    PYTHONPATH=. python tests/support/bad_input_counts.py

An area is a file tests/test_bad_input_<area>.py; its count is the number of test cases pytest
collects there (every table row, plus the area's other bad-input tests). Collection only: nothing runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def counts() -> Counter[str]:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_bad_input_*.py"))
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    found = (re.match(r"tests/test_bad_input_(\w+)\.py::", line) for line in done.stdout.splitlines())
    return Counter(m.group(1) for m in found if m)


def main() -> None:
    per_area = counts()
    for area, n in sorted(per_area.items()):
        print(f"{area:<14}{n:>5}")
    print(f"{'total':<14}{sum(per_area.values()):>5}")


if __name__ == "__main__":
    main()
