"""The bad-input suite's harness: run one bad input as a user would and judge the answer.

A case is a real command line (`python -m bigclip ...`, or any argv) against files a fixture made.
It passes when the command exits non-zero (2: bigclip's user error) having spent at most `max_s`
seconds of CPU (the work it did before refusing; wall time, which a loaded machine stretches
several-fold, is bounded only loosely, to catch a command that waits instead of refusing), prints
no traceback, ends its stderr with one line that contains every fragment of `says` (what is wrong
and what to do), leaves every protected folder byte for byte as it was, and adds nothing to the
working directory (no run folder, no log file; a run that started before failing keeps its folder,
named in `leaves`). Each area's rows live in tests/test_bad_input_<area>.py, each a table of `Case`s.
"""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTLED_BEFORE_WORK_S = 5.0  # the bound for anything flags or a manifest can settle
# What needs torch to tell (its devices, the machine's limits as a launched rank sees them, a storage
# client): torch's import alone is 3-5 s of CPU on an idle 2-core box, and more under a test load.
TORCH_FIRST_S = 15.0
WALL_PER_CPU = (
    6  # wall seconds allowed per CPU second of budget: two test workers and their ranks share 2 cores
)


@dataclass(frozen=True)
class Case:
    """One bad input. `argv` follows `python`; `says`: fragments the last stderr line must hold."""

    name: str
    argv: tuple[str, ...]
    says: tuple[str, ...]
    code: int = 2
    max_s: float = SETTLED_BEFORE_WORK_S
    env: dict[str, str | None] = field(default_factory=dict)  # None: removed from the environment
    # Folders (relative to the working directory) a run that started before failing keeps: its log.
    leaves: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str
    seconds: float  # wall
    cpu_seconds: float  # user + system of the command and every process it waited for

    @property
    def last_line(self) -> str:
        lines = [x for x in self.stderr.splitlines() if x.strip()]
        return lines[-1] if lines else ""


def bigclip(*args: str) -> tuple[str, ...]:
    return ("-m", "bigclip", *args)


def run(case: Case, *, cwd: Path, timeout_s: float = 300) -> Outcome:
    env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(ROOT), **case.env}.items() if v is not None}
    start, cpu = time.monotonic(), _children_cpu_s()
    done = subprocess.run(
        [sys.executable, *case.argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    seconds, cpu_seconds = time.monotonic() - start, _children_cpu_s() - cpu
    return Outcome(done.returncode, done.stdout, done.stderr, seconds, cpu_seconds)


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (a test runs one command at a time)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_digest(paths: Iterable[Path]) -> dict[str, str]:
    """sha256 of every file under `paths` (a missing path digests as missing)."""
    digest: dict[str, str] = {}
    for root in paths:
        if not root.exists():
            digest[str(root)] = "missing"
            continue
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            digest[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return digest


def tree_paths(root: Path) -> set[str]:
    """Every file and folder under `root`, relative to it."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _kept(path: str, leaves: tuple[str, ...]) -> bool:
    """`path` is a folder in `leaves`, inside one, or one's parent."""
    return any(f"{path}/".startswith(f"{f}/") or f.startswith(f"{path}/") for f in leaves)


def check(case: Case, *, cwd: Path, protect: Iterable[Path] = ()) -> Outcome:
    """Run `case` and assert the suite's five promises; returns the outcome for extra checks."""
    protect = list(protect)
    before, present = tree_digest(protect), tree_paths(cwd)
    out = run(case, cwd=cwd)
    took = f"{out.cpu_seconds:.1f}s CPU, {out.seconds:.1f}s wall"
    context = f"[{case.name}] exit {out.code} in {took}\nstderr:\n{out.stderr[-3000:]}"
    assert out.code == case.code, context
    assert "Traceback" not in out.stderr + out.stdout, context
    missing = [s for s in case.says if s not in out.last_line]
    assert not missing, f"{context}\nlast line lacks {missing}: {out.last_line!r}"
    assert out.cpu_seconds <= case.max_s, f"{context}\ntook {out.cpu_seconds:.1f}s of CPU > {case.max_s}s"
    wall = WALL_PER_CPU * case.max_s
    assert out.seconds <= wall, f"{context}\nwaited: {out.seconds:.1f}s wall > {wall}s"
    assert tree_digest(protect) == before, f"{context}\na protected file changed"
    added = [p for p in sorted(tree_paths(cwd) - present) if not _kept(p, case.leaves)]
    assert not added, f"{context}\na refused command left {added[:5]} in its working directory"
    return out
