"""Start training ranks as separate processes, the way `srun` does (SLURM_PROCID / SLURM_NTASKS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bigclip.distributed import free_port

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def srun_like(
    argv: list[str], world: int, log_dir: Path, env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES} | (env or {})
        rank_env |= {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}  # fmt: skip
        log = open(log_dir / f"rank{rank}.log", "ab")  # noqa: SIM115 (owned by the child process)
        procs.append(subprocess.Popen([sys.executable, "-m", "bigclip.train", *argv], env=rank_env,
                                      stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    return procs


def wait_all(procs: list[subprocess.Popen], timeout_s: float = 600) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    return codes


def read_keys(prefix: Path, rank: int) -> dict[int, list[str]]:
    """Step -> sample keys, from --batch-keys-file PREFIX (last write wins for a repeated step)."""
    path = Path(f"{prefix}.rank{rank}.jsonl")
    if not path.exists():
        return {}
    return {row["step"]: row["keys"] for row in map(json.loads, path.read_text().splitlines())}


def wait_for_step(prefix: Path, step: int, procs: list[subprocess.Popen], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while max(read_keys(prefix, 0), default=-1) < step:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"training did not reach step {step}")
        time.sleep(0.2)
