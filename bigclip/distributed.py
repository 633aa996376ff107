"""Process-group set-up from whatever launched us, and a local multi-process runner.

Launchers and the variables they set:
  torchrun / deepspeed      RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
  srun (one task per GPU)   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (+ MASTER_ADDR/PORT from the sbatch script)
  plain `python`            nothing: a world of one on a free local port

Gloo connects lazily here (TORCH_GLOO_LAZY_INIT=1, unless the environment says otherwise): by
default each gloo group opens a full mesh when it is made, a socket per peer in every process, two
groups (cpu_group and the checkpoint store's) so at least 2 x world sockets per process, and about
a million TCP connections at once across 1024 ranks. Lazily, a process connects to the peers its
collectives reach: a handful (ring, tree and dissemination neighbours; benchmarks/scale_sockets.py
measures them), all of them only where one rank gathers from every other (the checkpoint
coordinator, rank 0). Collectives from two threads on two groups (an async save's background thread
beside the training loop) stay apart as before: each group has its own connections
(tests/test_sockets.py runs both at once). What a process may still need is checked before start:
train/preflight.py, check_open_files.
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

from bigclip.rank_env import read_launch_env


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
    """(rank, world_size, local_rank) from the launcher's environment variables (rank_env.py:
    values no launcher writes are a ConfigError)."""
    return read_launch_env(os.environ)


def pick_device(local_rank: int, requested: str = "") -> torch.device:
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and device.index is None:  # --device cuda: this rank's GPU
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


DEFAULT_TIMEOUT_S = 1800
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"  # torch >= 2.11 reads it when a gloo group is made


def connect_gloo_lazily() -> None:
    """Make the gloo groups created from now on connect peer by peer, as collectives need them
    (unless the environment already chose)."""
    os.environ.setdefault(GLOO_LAZY_INIT, "1")


def gloo_connects_lazily() -> bool:
    """Whether the gloo groups bigclip makes connect lazily (torch's reading of the variable;
    init_distributed sets it where it is unset)."""
    value = os.environ.get(GLOO_LAZY_INIT, "1")
    return value.strip().lower() in ("1", "y", "yes", "t", "true")


_timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)  # of every group made here (see cpu_group)


def init_distributed(*, backend: str = "", device: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> Runtime:
    """Initialise the default process group (idempotent) and return this process's Runtime.

    `timeout_s` bounds every collective of the groups made here, on gloo and NCCL alike: a peer
    that died or hangs turns into an error after it instead of a wait without end (NCCL's own
    watchdog then tears the process down; TORCH_NCCL_ASYNC_ERROR_HANDLING).
    """
    global _timeout
    rank, world_size, local_rank = launch_env()
    dev = pick_device(local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        connect_gloo_lazily()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise RuntimeError(
                    "MASTER_PORT is not set; launch with torchrun, deepspeed or the slurm/ scripts"
                )
            os.environ["MASTER_PORT"] = str(free_port())
        _timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend or ("nccl" if dev.type == "cuda" else "gloo"),
            rank=rank,
            world_size=world_size,
            timeout=_timeout,
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
        # new_group's default timeout is torch's (30 min), not the world's: pass ours.
        _gloo_group = (dist.group.WORLD, dist.new_group(backend="gloo", timeout=_timeout))
    return _gloo_group[1]


def on_rank0(fn: Callable[[], Any], *, failed: Callable[[Exception], Exception] = lambda e: e) -> Any:
    """`fn()` run by rank 0 alone and its result broadcast (its failure, through `failed`, raised on
    every rank): one listing or read of a bucket for the job, not one burst per rank. Collective."""
    group = cpu_group()
    if group is None or dist.get_world_size(group) == 1:
        return fn()
    result: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            result[0] = fn()
        except Exception as e:  # sent to every rank, so all of them stop with the same message
            result[0] = failed(e)
    dist.broadcast_object_list(result, src=0, group=group)
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def side_store(*, prefix: str, timeout_s: float) -> Any:
    """A key-value store all ranks share beside the process group, for liveness checks that must
    not queue behind a hung collective: the default group's own store (TCPStore from env:// or
    torchrun's agent, FileStore from file://), reached through a client of its own whose
    waits for a key give up after `timeout_s` (the group's client waits as long as the group's
    timeout; a request the server never answers blocks either: train/bounded_store.py). None
    outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return store_client(base.host, base.port, prefix=prefix, timeout_s=timeout_s)
    return dist.PrefixStore(prefix, base)


def store_client(host: str, port: int, *, prefix: str, timeout_s: float) -> Any:
    """A new connection to the TCPStore at host:port, its keys under `prefix`. A refused connection
    (the store's process has ended) raises at once: torch's client would retry it until its timeout."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass
    timeout = datetime.timedelta(seconds=timeout_s)
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(prefix, client)


# What every rank imports anyway, imported once by the fork server the ranks start from: a rank
# then starts in milliseconds instead of spending 2-3 s of CPU importing torch afresh.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp"]


def _spawn_entry(
    rank: int, world_size: int, init_file: str, call: bytes, results: Any, environ: dict[str, str]
) -> None:
    # A fork server's children inherit the server's environment: run in the caller's, as of the
    # call, and only then unpickle the function, as importing its module may read the environment.
    os.environ.clear()
    os.environ.update(environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    connect_gloo_lazily()  # as init_distributed does: every multi-rank test runs the run's way
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(call)
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
    (a module-level function): the processes start from a fork server (a clean process that
    imported torch once, `FORKSERVER_PRELOAD`), not from a fork of the caller, and run in the
    caller's environment as of the call (torch itself was imported under the server's, set at the
    first call). `fn` and `args` are pickled in the caller. The first failing
    rank's traceback is raised and its peers, likely stuck in a collective, are terminated.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts (first use)
    results = ctx.SimpleQueue()
    outcomes: dict[int, tuple[bool, Any]] = {}
    call, environ = pickle.dumps((fn, args)), dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_spawn_entry, args=(r, world_size, init_file, call, results, environ))
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
