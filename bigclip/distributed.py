"""Process-group set-up from whatever launched us, and a local multi-process runner.

Launchers and the variables they set:
  torchrun / deepspeed      RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
  srun (one task per GPU)   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (+ MASTER_ADDR/PORT from the sbatch script)
  plain `python`            nothing: a world of one on a free local port
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def pick_device(local_rank: int, requested: str = "") -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(*, backend: str = "", device: str = "", timeout_s: int = 1800) -> Runtime:
    """Initialise the default process group (idempotent) and return this process's Runtime."""
    rank, world_size, local_rank = launch_env()
    dev = pick_device(local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise RuntimeError(
                    "MASTER_PORT is not set; launch with torchrun, deepspeed or the slurm/ scripts"
                )
            os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group(
            backend=backend or ("nccl" if dev.type == "cuda" else "gloo"),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


_gloo_group: Any = None


def cpu_group() -> Any:
    """A gloo group for tiny per-step CPU collectives (data-loader epoch end, preemption flags):
    the default group when it is gloo, else one new gloo group shared by all callers.

    Must first be called by all ranks together (it may create a group). None outside torch.distributed.
    """
    global _gloo_group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if _gloo_group is None or _gloo_group[0] is not dist.group.WORLD:  # new default group: new gloo group
        # An NCCL flag all-reduce would need a device tensor and a GPU sync every step.
        _gloo_group = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _gloo_group[1]


def _spawn_entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # Plain pickle bytes: the queue's own pickler would pass tensors as shared-memory
        # handles that die with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 900) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes over a gloo group.

    Returns each rank's return value (they must pickle). Used by multi-rank tests and
    benchmarks: real processes and real collectives, no mocks. `fn` must be importable
    (a module-level function), as the processes are started with 'spawn'. The first failing
    rank's traceback is raised and its peers, likely stuck in a collective, are terminated.
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    outcomes: dict[int, tuple[bool, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_spawn_entry, args=(r, world_size, init_file, fn, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            failure = _collect(procs, results, outcomes, deadline)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join()
    if failure:
        raise RuntimeError("a spawned rank failed:\n" + failure)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _collect(procs: list, results: Any, outcomes: dict, deadline: float) -> str | None:
    """Gather results until all ranks report; return the first failure's message, if any."""
    while len(outcomes) < len(procs):
        while not results.empty():
            rank, ok, value = results.get()
            outcomes[rank] = (ok, value)
            if not ok:
                return f"rank {rank}:\n{value}"
        dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode not in (None, 0)]
        if dead and results.empty():
            return f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
        if time.monotonic() > deadline:
            return f"timed out; ranks without a result: {sorted(set(range(len(procs))) - set(outcomes))}"
        time.sleep(0.02)
    return None
