"""A real two-node Slurm on one box: each node a network namespace, joined by a veth pair.

    with TwoNodeCluster.start(tmp_dir) as cluster:
        job = cluster.sbatch(script, "-p", "batch")      # submitted on node0, as a user would
        cluster.limit_link(1, rate="20mbit")              # tc tbf inside node1's namespace
        cluster.kill_node(1)                              # SIGKILL every process of node1's namespace

Layout (NAME = bc<pid>: two clusters never share a namespace name):
  NAMEn0  node0  10.213.0.1  slurmctld + slurmd   veth `bc0` <-> `bc0`   NAMEn1  node1  10.213.0.2  slurmd
The addresses exist only on that veth pair, which lives entirely inside the two namespaces: the
root namespace, its interfaces and routes are never touched, and no other address is ever a
target. Each node also has its own UTS namespace with the node's hostname, and an /etc/hosts
naming both nodes (`ip netns exec` bind-mounts /etc/netns/NS/hosts over /etc/hosts), so Slurm's
node names, torch's MASTER_ADDR and gloo's own address (it resolves the hostname) all work as on a
real cluster. munged runs in the root namespace: its socket is a file, reachable from both.
Client commands (sbatch, scontrol, ...) run on node0 (`cluster.prefix`).
Teardown: the daemons by PID, then every process left in each namespace (`ip netns pids`), then
the namespaces and their /etc/netns folders by name; `start` tears down what it made if it fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from support.slurm_cluster import (
    GPUS,
    SlurmCluster,
    _daemon,
    _make_fake_gpus,
    _stop_pid,
    _wait_pid,
    config,
    start_munged,
)

SUBNET = "10.213.0"  # private, and only ever on the veth pair between the two namespaces
IFACE = "bc0"
PORTS = (6817, 6818)  # slurmctld, slurmd: free, since each namespace has its own ports
HOSTS = "/etc/netns/{netns}/hosts"  # what `ip netns exec` bind-mounts over /etc/hosts
SLURMD_TIMEOUT_S = 10  # a node that stops answering is DOWN (and its job requeued) this soon


@dataclass(frozen=True)
class Node:
    name: str
    netns: str
    addr: str

    @property
    def exec(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def daemon(self, *argv: str) -> list[str]:
        """argv as a daemon of this node: its network, its hostname, its /etc/hosts. Not `ip netns
        exec`, whose fresh /sys hides the cgroup mounts slurmd needs."""
        inner = (
            f'mount --bind {HOSTS.format(netns=self.netns)} /etc/hosts && hostname {self.name} && exec "$@"'
        )
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--uts", "sh", "-c", inner,
                self.name, *argv]  # fmt: skip


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_pids(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in done.stdout.split()]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class TwoNodeCluster(SlurmCluster):
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, *, timeout_s: float = 60) -> TwoNodeCluster:
        root = Path(root).resolve()
        tag = f"bc{os.getpid()}"
        nodes = [Node(f"node{i}", f"{tag}n{i}", f"{SUBNET}.{i + 1}") for i in range(2)]
        env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        cluster = cls(root, nodes[0].name, env, prefix=nodes[0].exec, nodes=nodes)
        try:
            cluster._network()
            cluster._configure()
            cluster.pids["munged"] = start_munged(root / "munge")
            cluster._slurmctld()
            for i in range(len(nodes)):
                cluster.start_slurmd(i)
            cluster._wait_idle(timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _network(self) -> None:
        a, b = self.nodes
        for node in self.nodes:
            _ip("netns", "add", node.netns)
            hosts = Path(HOSTS.format(netns=node.netns))
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in self.nodes))
        _ip("-n", a.netns, "link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", b.netns)
        for node in self.nodes:
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", IFACE)
            _ip("-n", node.netns, "link", "set", IFACE, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")

    def _configure(self) -> None:
        for node in self.nodes:
            (self.root / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        _make_fake_gpus()
        head = self.nodes[0]
        text = config(self.root, ctld=f"{head.name}({head.addr})", nodes={n.name: n.addr for n in self.nodes},
                      ctld_port=PORTS[0], slurmd_port=PORTS[1], slurmd_timeout_s=SLURMD_TIMEOUT_S)  # fmt: skip
        (self.root / "slurm.conf").write_text(text)
        names = ",".join(n.name for n in self.nodes)
        (self.root / "gres.conf").write_text(f"NodeName={names} Name=gpu File=/dev/fakegpu[0-{GPUS - 1}]\n")

    def _slurmctld(self) -> None:
        conf = str(self.root / "slurm.conf")
        subprocess.run(self.nodes[0].daemon(_daemon("slurmctld"), "-f", conf, "-i"), env=self.env, check=True,
                       capture_output=True, timeout=30)  # fmt: skip
        self.pids["slurmctld"] = _wait_pid(self.root / "slurmctld.pid")

    def start_slurmd(self, i: int) -> None:
        """slurmd of node i, in its namespace and under its own hostname (also: a node back from a reboot)."""
        node = self.nodes[i]
        pid_file = self.root / f"slurmd.{node.name}.pid"
        pid_file.unlink(missing_ok=True)
        argv = node.daemon(_daemon("slurmd"), "-f", str(self.root / "slurm.conf"), "-N", node.name)
        subprocess.run(argv, env=self.env, check=True, capture_output=True, timeout=30)
        self.pids[f"slurmd.{node.name}"] = _wait_pid(pid_file)

    def kill_node(self, i: int) -> list[int]:
        """A lost node: SIGKILL every process in node i's namespace (slurmd, job steps, ranks)."""
        self.pids.pop(f"slurmd.{self.nodes[i].name}", None)
        pids = netns_pids(self.nodes[i].netns)
        _kill_all(pids)
        return pids

    def limit_link(self, i: int, *, rate: str, burst: str = "64kb", latency: str = "100ms") -> None:
        """A slow link: a token bucket (tc tbf) on what node i sends."""
        subprocess.run([*self.nodes[i].exec, "tc", "qdisc", "replace", "dev", IFACE, "root", "tbf", "rate", rate,
                        "burst", burst, "latency", latency], check=True, capture_output=True, timeout=30)  # fmt: skip

    def unlimit_link(self, i: int) -> None:
        subprocess.run([*self.nodes[i].exec, "tc", "qdisc", "del", "dev", IFACE, "root"], capture_output=True,
                       timeout=30)  # fmt: skip

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-p", "batch", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def stop(self) -> None:
        """Daemons by PID, then what is left in each namespace, then the namespaces, by name."""
        for name in [n for n in self.pids if n.startswith("slurmd.")] + ["slurmctld", "munged"]:
            pid = self.pids.pop(name, None)
            if pid:
                _stop_pid(pid)
        for node in self.nodes:
            self._remove(node)

    def _remove(self, node: Node) -> None:
        for _ in range(50):  # what the daemons left: job steps, ranks, data workers
            pids = netns_pids(node.netns)
            if not pids:
                break
            _kill_all(pids)
            time.sleep(0.1)
        subprocess.run(["ip", "netns", "del", node.netns], capture_output=True, timeout=30)
        shutil.rmtree(Path("/etc/netns") / node.netns, ignore_errors=True)
