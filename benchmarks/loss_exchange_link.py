"""The chunked loss's ring exchange vs its all-gather exchange across a rate-limited link.

    python benchmarks/loss_exchange_link.py [--local 1024] [--rates none,1gbit,250mbit]  # root, iproute2

Two "nodes" on this box: two network namespaces joined by a veth pair (tests/support/netns_pair.py),
2 gloo ranks in each (4 in all; ranks 0-1 on node0, 2-3 on node1), with a token bucket (tc tbf) at
each rate on both ends of the link. Per rate and exchange, forward + backward of the CLIP loss on
fp32 features of ViT-bigG-14's width (1280): the slowest rank's time of a round, best of --repeats,
and the bytes node1 sent over the link per round (its interface counter; `payloads_sent` in units of
one rank's features, 2 x local x 1280 x 4 bytes). The link model checked
against it: a round needs at least bytes / rate on the link (`link_floor_s`); `link_share` is that
floor over the measured time (near 1: the link is the bottleneck and the model holds; low: compute
or latency dominates). Measured at 4 ranks: the ring sends 5 payloads per round over node1's side
of the link (3 forward, the gradient accumulators behind them), the all-gather 6 (3 gathered, 3
in the gradients' reduction). On the 2-core box the 4 ranks share 2 cores, so the unlimited rows
are compute-bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from common import print_table, write_results  # noqa: E402
from support.netns_pair import IFACE, create_network, limit_link, make_nodes, remove_network  # noqa: E402

WORLD, PER_NODE = 4, 2
METHODS = ("ring", "allgather")
RATE_BITS = {"k": 1e3, "m": 1e6, "g": 1e9}


def worker(args: argparse.Namespace) -> None:
    """One rank, inside its node's namespace: time `repeats` rounds of one exchange."""
    import torch
    import torch.distributed as dist
    from loss_time_gloo import build

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=WORLD)
    g = torch.Generator().manual_seed(args.rank)
    image = torch.nn.functional.normalize(torch.randn(args.local, 1280, generator=g), dim=-1).requires_grad_()
    text = torch.nn.functional.normalize(torch.randn(args.local, 1280, generator=g), dim=-1).requires_grad_()
    scale = torch.tensor(1 / 0.07, requires_grad=True)
    loss_fn, best = build(args.method, args.chunk), float("inf")
    counter = Path(f"/sys/class/net/{IFACE}/statistics/tx_bytes")  # this namespace's /sys (ip netns exec)
    dist.barrier()
    sent = -int(counter.read_text())
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        loss_fn(image, text, scale).backward()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item())
    dist.barrier()
    sent += int(counter.read_text())
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({"seconds": best}))
    if args.rank == PER_NODE:  # node1's first rank: what node1 sent during the rounds
        Path(args.out + ".node1").write_text(json.dumps({"sent": sent / args.repeats}))
    dist.destroy_process_group()


def run_round(nodes, method: str, args: argparse.Namespace, tmp: Path) -> dict:
    init, out = tmp / f"init-{method}-{time.monotonic_ns()}", tmp / "out.json"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                *nodes[rank // PER_NODE].exec,
                sys.executable,
                __file__,
                "--worker",
                "--rank",
                str(rank),
                "--init",
                str(init),
                "--out",
                str(out),
                "--method",
                method,
                "--local",
                str(args.local),
                "--chunk",
                str(args.chunk),
                "--repeats",
                str(args.repeats),
            ],
            env=env,
        )  # fmt: skip
        for rank in range(WORLD)
    ]
    if any(p.wait(timeout=900) for p in procs):
        raise RuntimeError(f"a rank of the {method} run failed (see its output above)")
    sent = json.loads(Path(f"{out}.node1").read_text())["sent"]
    return {"seconds": json.loads(out.read_text())["seconds"], "node1_sent_mb_per_round": sent / 1e6}


def payload_bytes(local: int) -> int:
    """One rank's image and text features (fp32): what an exchange moves per hop."""
    return 2 * local * 1280 * 4


def rate_bytes_per_s(rate: str) -> float:
    number, unit = rate[:-4], rate[-4].lower()  # e.g. 250mbit
    return float(number) * RATE_BITS[unit] / 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local", type=int, default=1024, help="samples per rank")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rates", default="none,1gbit,250mbit", help="tc tbf rates ('none': no limit)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--rank", "--init", "--out", "--method"):
        p.add_argument(hidden, default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.rank = int(args.rank)
        worker(args)
        return 0
    if os.geteuid() != 0:
        sys.exit("needs root: it makes two network namespaces (ip netns) and limits their link (tc)")
    nodes, rows = make_nodes(), []
    try:
        create_network(nodes)
        with tempfile.TemporaryDirectory() as tmp:
            for rate in args.rates.split(","):
                for node in nodes if rate != "none" else ():
                    limit_link(node, rate=rate, burst="256kb", latency="500ms")
                for method in METHODS:
                    row = {"rate": rate, "method": method, **run_round(nodes, method, args, Path(tmp))}
                    row["payloads_sent"] = row["node1_sent_mb_per_round"] * 1e6 / payload_bytes(args.local)
                    if rate != "none":
                        row["link_floor_s"] = row["node1_sent_mb_per_round"] * 1e6 / rate_bytes_per_s(rate)
                        row["link_share"] = row["link_floor_s"] / row["seconds"]
                    rows.append(row)
                    print_table(rows[-1:])
    finally:
        remove_network(nodes)
    print_table(rows, ["rate", "method", "seconds", "node1_sent_mb_per_round", "payloads_sent", "link_floor_s",
                       "link_share"])  # fmt: skip
    write_results("loss_exchange_link", rows, ranks=WORLD, ranks_per_node=PER_NODE, local=args.local,
                  chunk=args.chunk, embed_dim=1280, dtype="float32", loss="clip",
                  timing=f"slowest rank per round, best of {args.repeats}; tc tbf on both ends of the link")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
