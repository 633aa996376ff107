"""Jobs for the two-node Slurm tests: scripts rendered by `bigclip slurm`, submitted on node0.

Each job lives in ROOT/NAME (script, Slurm output, logs, batch keys). The interpreter given to
`bigclip slurm --python` is a two-line wrapper that prints where each process started
("bigclip test: start on HOST node N procid R") and then execs this venv's Python, so the Slurm
output shows which host ran which rank.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bigclip.launch.slurm import main as slurm_main
from support.slurm_cluster import missing_reason, start_for_tests
from support.slurm_two_nodes import TwoNodeCluster

ROOT = Path(__file__).resolve().parents[2]
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
WRAPPER = """#!/bin/bash
echo "bigclip test: start on $(hostname) node ${SLURM_NODEID:-?} procid ${SLURM_PROCID:-?}"
exec %s "$@"
"""


@contextmanager
def two_node_cluster(root: Path) -> Iterator[TwoNodeCluster]:
    """The cluster, or a skip saying why not (a failure under CI, which must run these tests)."""
    reason = missing_reason() or ("" if _has_ip() else "iproute2 (`ip`) is missing")
    cluster = start_for_tests(
        lambda: TwoNodeCluster.start(root / "cluster"), reason=reason, what="the two-node Slurm tests"
    )
    try:
        yield cluster
    finally:
        cluster.stop()


def _has_ip() -> bool:
    return any((Path(d) / "ip").exists() for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"))


def render(
    root: Path, name: str, *, data: str, steps: int, job: list[str], train: list[str] = (), run: str = ""
) -> Path:
    """`bigclip slurm` for the tiny model on CPU ranks (fp32, gloo), one step per log line; `run`:
    train on as that run (its logs and name: it resumes that run's latest checkpoint). The time
    limit is one no run comes near, however loaded the box (its warning would be a requeue)."""
    run = run or name
    out = root / name / "job.sbatch"
    out.parent.mkdir(parents=True)
    wrapper = root / name / "python"
    wrapper.write_text(WRAPPER % sys.executable)
    wrapper.chmod(0o755)
    job_args = ["--cpus-per-gpu", "1", "--no-exclusive", "--python", str(wrapper), "--signal-seconds", "60",
                "--checkpoint-seconds", "40", "--time", "02:00:00", "--chdir", str(out.parent), *job]  # fmt: skip
    train_args = ["--model", "tiny", "--train-data", data, "--precision", "fp32", "--batch-size", "16",
                  "--workers", "1", "--warmup", "2", "--epochs", "40", "--max-steps", str(steps),
                  "--save-every-n-steps", "4", "--save-frequency", "0", "--log-every-n-steps", "1",
                  "--local-loss", "--gather-with-grad", "--report-to", "", "--logs", str(root / run / "logs"),
                  "--name", run, "--batch-keys-file", str(keys_prefix(root, name)), *train]  # fmt: skip
    assert slurm_main([*job_args, *train_args, "-o", str(out)]) == 0
    return out


def submit(cluster: TwoNodeCluster, script: Path, partition: str = "batch") -> int:
    return cluster.sbatch(script, "-p", partition, cwd=script.parent)


def keys_prefix(root: Path, name: str) -> Path:
    return root / name / "keys"


def output(root: Path, name: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((root / name).glob("*.out")))


def losses(text: str) -> list[str]:
    """Rank 0's logged global loss at each step, as printed (4 decimals)."""
    return re.findall(r"Contrastive_loss: (\S+)", text)


def starts(text: str) -> set[tuple[str, str]]:
    """(host, SLURM_NODEID) of every process the wrapper started."""
    return set(re.findall(r"bigclip test: start on (\S+) node (\S+)", text))
