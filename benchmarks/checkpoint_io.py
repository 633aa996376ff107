"""Checkpoint I/O: bigclip's sharded DCP save/load straight to S3 vs torch.save + boto3.

One run, one loopback S3 endpoint (moto in its own process), the same sharded state
(default 1 GiB of fp32 across 2 gloo ranks), side by side:

  bigclip save     CheckpointStore.save: every rank streams its shards to S3; returns committed
  bigclip async    CheckpointStore.async_save: time blocked (staging), then time until committed
  baseline save    each rank torch.save()s its shard to local disk, then boto3 uploads the file
                   (upload_file: multipart, 10 threads); no fsync, as the pattern usually goes
  bigclip load     CheckpointStore.load into the preallocated sharded state
  baseline load    each rank downloads its file with boto3, torch.load(weights_only=True)s it
                   and copies it into the state

Times are the slowest rank's (barriers around each phase), medians over --repeats rounds;
rounds alternate whether bigclip or the baseline goes first. "server CPU s" is the CPU time
the loopback server spent in a phase: when it is close to the wall time, the server, not
the client, sets the pace.

    python benchmarks/checkpoint_io.py [--gib 1.0] [--ranks 2] [--repeats 3]
    python benchmarks/checkpoint_io.py --ranks 1 --name checkpoint_io_gpu    # one GPU

moto parses every request in one Python process (~9 CPU-s per GB), so on a small machine it,
not either client, sets the pace. `--endpoint URL [--server-pid PID]` runs the same comparison
against an S3-compatible server you started (s3rver, MinIO) or, with AWS_* credentials and
`--endpoint aws`, against S3 itself; the bucket (`--bucket`) is created when missing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import gpu_info, print_table, write_results  # noqa: E402
from bigclip.checkpoint import CheckpointStore  # noqa: E402
from bigclip.demo.loopback_s3 import LoopbackS3  # noqa: E402
from bigclip.distributed import spawn  # noqa: E402

TENSOR_MIB = 32


def sharded_state(world: int, total_bytes: int, device: torch.device) -> dict:
    """Sharded fp32 tensors (DTensor, Shard(0)) adding up to `total_bytes` across ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device.type, (world,))
    rows_per_rank, cols = TENSOR_MIB * 1024, 256  # 32 MiB of fp32 per rank per tensor
    count = max(1, round(total_bytes / (world * rows_per_rank * cols * 4)))
    g = torch.Generator().manual_seed(dist.get_rank())
    tensors = {}
    for i in range(count):
        local = torch.randn(rows_per_rank, cols, generator=g).to(device)
        tensors[f"layer{i:03d}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"model": tensors, "train": {"step": 0}}


def timed(fn) -> float:
    """Wall time of `fn` on the slowest rank (barriers on both sides)."""
    dist.barrier()
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def server_cpu_s(pid: int | None) -> float:
    """CPU seconds the S3 server process has used so far (0 when it is not on this machine)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(
    store: CheckpointStore, state: dict, round_: int, folder: Path, client, server_pid: int | None
) -> dict[str, float]:
    bucket, run_prefix = store.location.bucket, store.location.prefix.removesuffix("/bigclip")
    key = f"{run_prefix}/baseline/round{round_}/rank{dist.get_rank()}.pt"
    path = folder / f"rank{dist.get_rank()}.pt"
    times: dict[str, float] = {}

    def measure(name: str, fn) -> None:
        cpu_before = server_cpu_s(server_pid)
        times[f"{name}_s"] = timed(fn)
        times[f"{name}_server_cpu_s"] = server_cpu_s(server_pid) - cpu_before

    def ours_save() -> None:
        measure("bigclip_save", lambda: store.save(state, step=3 * round_))

    def ours_load() -> None:
        measure("bigclip_load", lambda: store.load(state, "latest"))

    def baseline_save() -> None:
        # The common pattern: torch.save to local disk (no fsync, as usual), then boto3 upload_file.
        measure(
            "baseline_torch_save",
            lambda: torch.save({k: v.to_local() for k, v in state["model"].items()}, path),
        )
        measure("baseline_upload", lambda: client.upload_file(str(path), bucket, key))
        path.unlink()

    def baseline_load() -> None:
        measure("baseline_download", lambda: client.download_file(bucket, key, str(path)))

        def read_into_state() -> None:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            for name, tensor in state["model"].items():
                tensor.to_local().copy_(loaded[name])

        measure("baseline_torch_load", read_into_state)
        path.unlink()

    # Alternate who goes first, so neither always meets the server in the same state.
    first_ours = round_ % 2 == 0
    for phase in (ours_save, baseline_save) if first_ours else (baseline_save, ours_save):
        phase()
    for phase in (ours_load, baseline_load) if first_ours else (baseline_load, ours_load):
        phase()
    times["baseline_save_s"] = times["baseline_torch_save_s"] + times["baseline_upload_s"]
    times["baseline_load_s"] = times["baseline_download_s"] + times["baseline_torch_load_s"]
    pending = None

    def start_async() -> None:
        nonlocal pending
        pending = store.async_save(state, step=3 * round_ + 1)

    times["async_blocked_s"] = timed(start_async)
    times["async_until_committed_s"] = times["async_blocked_s"] + timed(pending.wait)
    # Free the loopback server's memory (it keeps objects in RAM) before the next round.
    if dist.get_rank() == 0:
        store.apply_retention(keep_last=1)
    client.delete_object(Bucket=bucket, Key=key)
    dist.barrier()
    return times


def _rank_main(
    rank: int,
    world: int,
    total_bytes: int,
    repeats: int,
    endpoint_env: dict,
    server_pid: int | None,
    root: str,
) -> dict:
    os.environ.update(endpoint_env)
    from bigclip.storage.s3 import S3Settings, boto3_client

    # A GPU per rank where there are enough (state staged from device memory, pinned buffers);
    # else CPU: several ranks cannot share one GPU over gloo.
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    state = sharded_state(world, total_bytes, device)
    settings = S3Settings.resolve()
    store = CheckpointStore(f"{root}/bigclip")
    client = boto3_client(settings)
    rounds = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_LOCAL_DIR")) as tmp:
        for round_ in range(repeats):
            rounds.append(one_round(store, state, round_, Path(tmp), client, server_pid))
    store.close()
    local_bytes = sum(t.to_local().numel() * 4 for t in state["model"].values())
    return {"rounds": rounds, "local_bytes": local_bytes}


def summarize(results: list[dict]) -> tuple[list[dict], dict]:
    rounds = results[0]["rounds"]
    total_gb = sum(r["local_bytes"] for r in results) / 1e9
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    cpu = {k.removesuffix("_server_cpu_s"): v for k, v in median.items() if k.endswith("_server_cpu_s")}
    rows = [
        _row(
            "save until durable",
            "bigclip (DCP -> S3, committed)",
            median["bigclip_save_s"],
            total_gb,
            cpu["bigclip_save"],
        ),
        _row("save until durable", "torch.save + boto3 upload", median["baseline_save_s"], total_gb),
        _row("  of which", "torch.save to local disk", median["baseline_torch_save_s"], total_gb),
        _row(
            "  of which", "boto3 upload_file", median["baseline_upload_s"], total_gb, cpu["baseline_upload"]
        ),
        _row("save until durable", "bigclip async: blocked", median["async_blocked_s"], total_gb),
        _row(
            "save until durable",
            "bigclip async: until committed",
            median["async_until_committed_s"],
            total_gb,
        ),
        _row(
            "load", "bigclip (S3 -> DCP, in place)", median["bigclip_load_s"], total_gb, cpu["bigclip_load"]
        ),
        _row("load", "boto3 download + torch.load", median["baseline_load_s"], total_gb),
        _row(
            "  of which",
            "boto3 download_file",
            median["baseline_download_s"],
            total_gb,
            cpu["baseline_download"],
        ),
        _row("  of which", "torch.load + copy into state", median["baseline_torch_load_s"], total_gb),
    ]
    ratios = {
        "save_speedup_vs_baseline": median["baseline_save_s"] / median["bigclip_save_s"],
        "load_speedup_vs_baseline": median["baseline_load_s"] / median["bigclip_load_s"],
        "async_blocked_fraction_of_sync_save": median["async_blocked_s"] / median["bigclip_save_s"],
    }
    return rows, {"total_gb": total_gb, "rounds": rounds, **ratios}


def _row(phase: str, method: str, seconds: float, gb: float, server_cpu: float | None = None) -> dict:
    row = {"phase": phase, "method": method, "seconds": round(seconds, 3), "GB/s": round(gb / seconds, 4)}
    row["server CPU s"] = None if server_cpu is None else round(server_cpu, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="State size across all ranks, GiB.")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--endpoint", default="", help="An S3-compatible URL, or 'aws' (default: moto).")
    parser.add_argument("--server-pid", type=int, default=None, help="That server's pid, for its CPU time.")
    parser.add_argument("--bucket", default="bench-checkpoint-io")
    parser.add_argument("--name", default="checkpoint_io", help="Results file benchmarks/results/NAME.json.")
    args = parser.parse_args()
    with ExitStack() as stack:
        endpoint_env, server_pid, endpoint = endpoint_for(args, stack)
        results = spawn(
            _rank_main,
            args.ranks,
            int(args.gib * 2**30),
            args.repeats,
            endpoint_env,
            server_pid,
            f"s3://{args.bucket}/checkpoint-io-{os.getpid()}",  # this run's objects only
            timeout_s=3600,
        )
    rows, extra = summarize(results)
    print_table(rows)
    for name in (
        "save_speedup_vs_baseline",
        "load_speedup_vs_baseline",
        "async_blocked_fraction_of_sync_save",
    ):
        print(f"{name}: {extra[name]:.3f}")
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks
    gpu = gpu_info() if on_gpu else {}
    write_results(args.name, rows, ranks=args.ranks, endpoint=endpoint, state_on_gpu=on_gpu, **gpu, **extra)


def endpoint_for(args: argparse.Namespace, stack: ExitStack) -> tuple[dict, int | None, str]:
    """(environment for the ranks, server pid or None, description) for --endpoint."""
    if not args.endpoint:
        s3 = stack.enter_context(LoopbackS3())
        s3.create_bucket(args.bucket)
        return s3.env, s3._proc.pid, "loopback S3 (moto server, objects in RAM, one Python process)"
    env = {} if args.endpoint == "aws" else {"AWS_ENDPOINT_URL": args.endpoint}
    os.environ.update(env)
    from bigclip.storage.s3 import S3Settings, boto3_client

    client = boto3_client(S3Settings.resolve())
    try:
        client.head_bucket(Bucket=args.bucket)
    except client.exceptions.ClientError:
        client.create_bucket(Bucket=args.bucket)
    return env, args.server_pid, f"{args.endpoint} (bucket {args.bucket})"


if __name__ == "__main__":
    main()
