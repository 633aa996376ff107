"""Two "hosts" on one box: two network namespaces joined by a veth pair, for tests and benchmarks.

    nodes = make_nodes()              # node0 10.213.0.1 in bc<pid>n0, node1 10.213.0.2 in bc<pid>n1
    create_network(nodes)
    limit_link(nodes[1], rate="200mbit")   # tc tbf on what node1 sends (this kernel has no netem)
    set_link(nodes[1], up=False)      # a cut cable (then up=True: back)
    remove_network(nodes)             # SIGKILLs what is left in them, deletes them by name

The addresses exist only on the veth pair, which lives entirely inside the two namespaces: the
root namespace, its interfaces and routes are never touched, and no other address is ever a
target. The interface is IFACE in both namespaces (GLOO_SOCKET_IFNAME can name it). Each node's
/etc/hosts names both nodes: `ip netns exec` bind-mounts /etc/netns/NS/hosts over /etc/hosts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.0"  # private, and only ever on the veth pair between the two namespaces
IFACE = "bc0"
HOSTS = "/etc/netns/{netns}/hosts"  # what `ip netns exec` bind-mounts over /etc/hosts


@dataclass(frozen=True)
class Node:
    name: str
    netns: str
    addr: str

    @property
    def exec(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def daemon(self, *argv: str, binds: dict[str, str] | None = None) -> list[str]:
        """argv as a daemon of this node: its network, its hostname, its /etc/hosts, and `binds`
        (this node's folder -> a path, mounted in its mount namespace alone: a node-local disk at a
        path every node has). Not `ip netns exec`, whose fresh /sys hides the cgroup mounts slurmd needs."""
        mounts = "".join(
            f"mkdir -p {src} && mount --bind {src} {dst} && " for src, dst in (binds or {}).items()
        )
        inner = f'mount --bind {HOSTS.format(netns=self.netns)} /etc/hosts && {mounts}hostname {self.name} && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--uts", "sh", "-c", inner,
                self.name, *argv]  # fmt: skip


def make_nodes(count: int = 2) -> list[Node]:
    tag = f"bc{os.getpid()}"  # two users of this module never share a namespace name
    return [Node(f"node{i}", f"{tag}n{i}", f"{SUBNET}.{i + 1}") for i in range(count)]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def create_network(nodes: list[Node]) -> None:
    a, b = nodes
    for node in nodes:
        _ip("netns", "add", node.netns)
        hosts = Path(HOSTS.format(netns=node.netns))
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in nodes))
    _ip("-n", a.netns, "link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", b.netns)
    for node in nodes:
        _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", IFACE)
        _ip("-n", node.netns, "link", "set", IFACE, "up")
        _ip("-n", node.netns, "link", "set", "lo", "up")


def limit_link(node: Node, *, rate: str, burst: str = "64kb", latency: str = "100ms") -> None:
    """A slow link: a token bucket (tc tbf) on what `node` sends."""
    subprocess.run([*node.exec, "tc", "qdisc", "replace", "dev", IFACE, "root", "tbf", "rate", rate, "burst", burst,
                    "latency", latency], check=True, capture_output=True, timeout=30)  # fmt: skip


def set_link(node: Node, *, up: bool) -> None:
    """Take the node's end of the veth pair down (a cut cable: its sockets go silent, no reset is
    sent) or bring it back up."""
    _ip("-n", node.netns, "link", "set", IFACE, "up" if up else "down")


def unlimit_link(node: Node) -> None:
    subprocess.run([*node.exec, "tc", "qdisc", "del", "dev", IFACE, "root"], capture_output=True, timeout=30)


def netns_pids(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in done.stdout.split()]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def remove_network(nodes: list[Node]) -> None:
    """SIGKILL every process left in each namespace, then delete the namespaces, by name."""
    for node in nodes:
        for _ in range(50):
            pids = netns_pids(node.netns)
            if not pids:
                break
            kill_all(pids)
            time.sleep(0.1)
        subprocess.run(["ip", "netns", "del", node.netns], capture_output=True, timeout=30)
        shutil.rmtree(Path(HOSTS.format(netns=node.netns)).parent, ignore_errors=True)
