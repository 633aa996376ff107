"""The chunked loss's ring exchange vs its all-gather exchange across a rate-limited link.

    python benchmarks/loss_exchange_link.py [--local 1024] [--rates none,1gbit,250mbit]  # root, iproute2

Two "nodes" on this box: two network namespaces joined by a veth pair (tests/support/netns_pair.py),
2 gloo ranks in each (4 in all; ranks 0-1 on node0, 2-3 on node1), with a token bucket (tc tbf, a
bucket of 2 ms at the rate) on both ends of the link. Per rate, one set of ranks runs each exchange
in turn: forward + backward of the CLIP loss on fp32 features of ViT-bigG-14's width (1280), the
slowest rank's time of a round, best of --repeats, and what node1 sent over the link per round (its
interface counters: TCP payload, and bytes on the wire with headers, which tbf meters;
`payloads_sent` in units of one rank's features, 2 x local x 1280 x 4 bytes). The link model
checked against it: a round needs at least wire bytes / rate (`link_floor_s`); `link_share` is that
floor over the measured time (near 1: the link is the bottleneck; low: compute or latency
dominates). Measured at 4 ranks: the ring sends 5 payloads per round over node1's side of the link
(3 forward, the gradient accumulators behind them), the all-gather 6 (3 gathered, 3 in the
gradients' reduction, which gloo runs as an all-reduce). On the 2-core box the 4 ranks share 2
cores, so the unlimited rows are compute-bound. `busbw_gbps`: an all-gather's bus bandwidth over
the same link, measured first (what nccl-tests reports, and what `bigclip plan --link-gbps` takes). `measure_exchange` is also what
plan_vs_measured.py --link compares the planner with.
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

from common import env_with_checkout, print_table, write_results  # noqa: E402
from support.netns_pair import (  # noqa: E402
    IFACE,
    Node,
    create_network,
    limit_link,
    make_nodes,
    remove_network,
    unlimit_link,
)

WORLD, PER_NODE = 4, 2
METHODS = ("ring", "allgather")
RATE_BITS = {"k": 1e3, "m": 1e6, "g": 1e9}
HEADER_BYTES = 14 + 20 + 32  # Ethernet, IPv4, TCP with timestamps (Linux's default)


def worker(args: argparse.Namespace) -> None:
    """One rank, inside its node's namespace: per exchange, time `repeats` rounds and count the link."""
    import torch
    import torch.distributed as dist
    from loss_time_gloo import build

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=WORLD)
    g = torch.Generator().manual_seed(args.rank)
    image = torch.nn.functional.normalize(torch.randn(args.local, 1280, generator=g), dim=-1).requires_grad_()
    text = torch.nn.functional.normalize(torch.randn(args.local, 1280, generator=g), dim=-1).requires_grad_()
    scale = torch.tensor(1 / 0.07, requires_grad=True)
    result = {"busbw_gbps": bus_bandwidth_gbps(args)}
    for method in args.method.split(","):
        loss_fn, rounds = build(method, args.chunk), []
        dist.barrier()
        before = link_counters()
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            loss_fn(image, text, scale).backward()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rounds.append(elapsed.item())
        dist.barrier()
        result[method] = {
            "seconds": min(rounds),
            "spread": max(rounds) / min(rounds),
            **{k: (v - before[k]) / args.repeats for k, v in link_counters().items()},
        }
    if args.rank in (0, PER_NODE):  # rank 0: the times; node1's first rank: what node1 sent
        Path(f"{args.out}.{args.rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def bus_bandwidth_gbps(args: argparse.Namespace) -> float:
    """The link as nccl-tests would report it: an all-gather of one rank's text features, its
    bus bandwidth ((W-1) inputs sent per rank over the slowest rank's time, best of --repeats)."""
    import torch
    import torch.distributed as dist

    from bigclip.ops.loss.collectives import all_gather_single

    x = torch.ones(args.local, 1280)
    out, best = torch.empty(WORLD * args.local, 1280), float("inf")
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        all_gather_single(out, x)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item())
    return (WORLD - 1) * x.nbytes * 8 / best / 1e9


def link_counters() -> dict[str, int]:
    """What this node sent over the link: bytes on the wire, TCP payload (each packet, pure ACKs
    included, carries HEADER_BYTES of headers; segmentation below the 64 KB GSO size, as tbf does
    at low rates, multiplies them), and TCP's retransmission timeouts (each stalls a connection for
    at least 200 ms). Read from this namespace's /sys and /proc/net (`ip netns exec`)."""
    stats = Path(f"/sys/class/net/{IFACE}/statistics")
    wire, packets = (int((stats / name).read_text()) for name in ("tx_bytes", "tx_packets"))
    names, values = (line.split() for line in Path("/proc/net/netstat").read_text().splitlines()[:2])
    timeouts = int(dict(zip(names, values))["TCPTimeouts"])
    return {"wire": wire, "payload": wire - HEADER_BYTES * packets, "rto": timeouts}


def run_rate(nodes: list[Node], methods: tuple[str, ...], args: argparse.Namespace, tmp: Path) -> dict:
    """{method: {seconds, spread (worst / best round), node1 sent/wire MB per round, busbw_gbps}} of one set of 4 ranks at the link's current rate."""
    init, out = tmp / f"init-{time.monotonic_ns()}", tmp / "out"
    env = {**env_with_checkout(), "GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1"}
    flags = ["--worker", "--init", str(init), "--out", str(out), "--method", ",".join(methods),
             "--local", str(args.local), "--chunk", str(args.chunk), "--repeats", str(args.repeats)]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*nodes[r // PER_NODE].exec, sys.executable, __file__, *flags, "--rank", str(r)], env=env
        )
        for r in range(WORLD)
    ]
    if any(p.wait(timeout=900) for p in procs):
        raise RuntimeError(f"a rank of the {methods} run failed (see its output above)")
    times, sent = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, PER_NODE))
    return {
        m: {"seconds": times[m]["seconds"], "spread": times[m]["spread"], "busbw_gbps": times["busbw_gbps"],
            "node1_sent_mb_per_round": sent[m]["payload"] / 1e6, "node1_wire_mb_per_round": sent[m]["wire"] / 1e6,
            "node1_rto_per_round": sent[m]["rto"]}
        for m in methods
    }  # fmt: skip


def measure_exchange(
    rates: list[str], args: argparse.Namespace, *, methods: tuple[str, ...] = METHODS
) -> list[dict]:
    """Rows of (rate, method, seconds, node1_sent_mb_per_round) over a fresh namespace pair (root).
    `args` carries local, chunk and repeats; a rate of 'none' leaves the link unlimited."""
    if os.geteuid() != 0:
        sys.exit("needs root: it makes two network namespaces (ip netns) and limits their link (tc)")
    nodes, rows = make_nodes(), []
    try:
        create_network(nodes)
        with tempfile.TemporaryDirectory() as tmp:
            for rate in rates:
                for node in nodes:
                    if rate == "none":
                        unlimit_link(node)
                    else:  # a bucket of 2 ms at the rate (64 KB at least): tbf needs one tick's worth
                        burst = max(64 * 1024, int(rate_bytes_per_s(rate) * 2e-3))
                        limit_link(node, rate=rate, burst=str(burst), latency="500ms")
                measured = run_rate(nodes, methods, args, Path(tmp))
                rows += [{"rate": rate, "method": m, **measured[m]} for m in methods]
                print_table(rows[-len(methods) :])
    finally:
        remove_network(nodes)
    return rows


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
    rows = measure_exchange(args.rates.split(","), args)
    for row in rows:
        row["payloads_sent"] = row["node1_sent_mb_per_round"] * 1e6 / payload_bytes(args.local)
        if row["rate"] != "none":
            row["link_floor_s"] = row["node1_wire_mb_per_round"] * 1e6 / rate_bytes_per_s(row["rate"])
            row["link_share"] = row["link_floor_s"] / row["seconds"]
    print_table(rows, ["rate", "method", "seconds", "node1_sent_mb_per_round", "payloads_sent", "link_floor_s",
                       "link_share"])  # fmt: skip
    write_results("loss_exchange_link", rows, ranks=WORLD, ranks_per_node=PER_NODE, local=args.local,
                  chunk=args.chunk, embed_dim=1280, dtype="float32", loss="clip",
                  timing=f"slowest rank per round, best of {args.repeats}; tc tbf on both ends of the link")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
