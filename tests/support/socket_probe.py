"""Sockets per process of a real W-rank run's process groups: the harness of tests/test_sockets.py and
benchmarks/scale_sockets.py.

    counts = probe(8, lazy=True)     # {rank: {"init": n, "training": n, "checkpoint": n, ...}}

W processes (a fork server's, torch imported once) start as srun starts ranks (SLURM_PROCID,
SLURM_NTASKS, MASTER_ADDR/PORT: env://, rank 0 hosts the TCPStore) and set up what a CPU run of
bigclip does: `init_distributed` (the default group, gloo), `cpu_group`, the step watchdog's side
store connection, a CheckpointStore (its own gloo group). Then, counting the sockets in
/proc/self/fd after each phase:
  init        groups made, no collective yet;
  training    per-step collectives on the CPU group: all_reduce (the stop flags), all_gather_object
              (the data loader's epoch end), barrier;
  checkpoint  a checkpoint saved, then an async save whose upload and commit (DCP's plan exchange,
              the manifest gather) run on a background thread while the main thread keeps
              all-reducing on the CPU group: the two threads' collectives, each on its group.
Each rank also reports whether every collective returned the right value and the async save
committed, and its open files in all. `lazy=False` sets TORCH_GLOO_LAZY_INIT=0 (gloo's full mesh).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
from typing import Any

PHASES = ("init", "training", "checkpoint")


def sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def probe(world: int, *, lazy: bool, timeout_s: float = 600) -> dict[int, dict[str, Any]]:
    """Run the W ranks; each rank's counts and checks."""
    from bigclip.distributed import free_port

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "torch.distributed.checkpoint", "bigclip.checkpoint"]
    )
    results = ctx.Queue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "SLURM_NTASKS": str(world),
           "OMP_NUM_THREADS": "1", "TORCH_GLOO_LAZY_INIT": "1" if lazy else "0"}  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        procs = [ctx.Process(target=_rank, args=(r, env, root, results), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        try:
            out = {}
            for _ in range(world):
                rank, value = results.get(timeout=timeout_s)
                if isinstance(value, str):
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = value
            return out
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


def _rank(rank: int, env: dict[str, str], root: str, results: Any) -> None:
    import traceback

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)
    os.environ.update(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
    try:
        results.put((rank, _phases(root)))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _phases(root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from bigclip.checkpoint import CheckpointStore
    from bigclip.distributed import cpu_group, init_distributed, side_store

    torch.set_num_threads(1)
    runtime = init_distributed(backend="gloo", timeout_s=300)
    group, world = cpu_group(), runtime.world_size
    heartbeats = side_store(prefix="probe", timeout_s=30)  # the step watchdog's connection
    store = CheckpointStore(os.path.join(root, "checkpoints"), timeout_s=300)
    counts: dict[str, Any] = {"init": sockets(), "lazy": os.environ.get("TORCH_GLOO_LAZY_INIT")}
    ok = True
    for step in range(3):
        flag = torch.tensor([float(runtime.rank + step)])
        dist.all_reduce(flag, group=group)
        ok &= flag.item() == sum(r + step for r in range(world))
        gathered = [None] * world
        dist.all_gather_object(gathered, (runtime.rank, step), group=group)
        ok &= gathered == [(r, step) for r in range(world)]
        dist.barrier(group=group)
    counts["training"] = sockets()
    state = {"weights": torch.arange(4.0) + runtime.rank, "rank": runtime.rank}
    store.save(state, step=1)
    pending = store.async_save({**state, "step": 2}, step=2)
    rounds, uploading = 0, True
    while uploading or rounds < 3:  # the training loop's collectives meanwhile, as many on every rank
        ones, done = torch.ones(1), torch.tensor([float(pending.done())])
        dist.all_reduce(ones, group=group)
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=group)
        ok &= ones.item() == world
        rounds, uploading = rounds + 1, done.item() == 0
    counts |= {"checkpoint": sockets(), "committed": pending.wait() is not None, "collectives_ok": bool(ok),
               "rounds_beside_upload": rounds, "open_files": len(os.listdir("/proc/self/fd"))}  # fmt: skip
    store.close()
    del heartbeats
    dist.barrier(group=group)
    return counts
