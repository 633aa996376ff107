"""A real two-node Slurm on one box: each node a network namespace, joined by a veth pair.

    with TwoNodeCluster.start(tmp_dir) as cluster:
        job = cluster.sbatch(script, "-p", "batch")      # submitted on node0, as a user would
        cluster.limit_link(1, rate="20mbit")              # tc tbf inside node1's namespace
        cluster.local                                     # one path, each node's own folder behind it
        cluster.kill_node(1)                              # SIGKILL every process of node1's namespace
        cluster.start_slurmd(1)                           # ... and the node is back
        cluster.set_link(1, up=False)                     # a cut cable

The network is support/netns_pair.py's (NAME = bc<pid>: two clusters never share a namespace name):
  NAMEn0  node0  10.213.0.1  slurmctld + slurmd   veth `bc0` <-> `bc0`   NAMEn1  node1  10.213.0.2  slurmd
Each daemon also has its node's UTS namespace (hostname) and /etc/hosts naming both nodes, so
Slurm's node names, torch's MASTER_ADDR and gloo's own address (it resolves the hostname) all work
as on a real cluster, and its own mount namespace, where ROOT/local is ROOT/local-NODE: a folder at
the same path on both nodes but a different one on each, as a node-local disk (/local-nvme) is. munged runs in the root namespace: its socket is a file, reachable from both.
Client commands (sbatch, scontrol, ...) run on node0 (`cluster.prefix`).
Teardown: the daemons by PID, then every process left in each namespace (`ip netns pids`), then
the namespaces and their /etc/netns folders by name; `start` tears down what it made if it fails.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from support.netns_pair import (
    IFACE,
    Node,
    create_network,
    kill_all,
    limit_link,
    make_nodes,
    netns_pids,
    remove_network,
    set_link,
    unlimit_link,
)
from support.slurm_cluster import (
    SlurmCluster,
    _daemon,
    _make_fake_gpus,
    _stop_pid,
    _wait_pid,
    config,
    start_munged,
)

PORTS = (6817, 6818)  # slurmctld, slurmd: free, since each namespace has its own ports
SLURMD_TIMEOUT_S = 120  # longer than the lost-node test takes: the watchdog, not Slurm, must notice
# Fake GPUs per node: room for four jobs of `--gpus-per-node 2` at once, so the two-node tests' jobs
# run side by side (with 2 a node, they queued behind each other, one at a time).
GPUS_PER_NODE = 8
__all__ = ["GPUS_PER_NODE", "IFACE", "Node", "TwoNodeCluster"]


@dataclass
class TwoNodeCluster(SlurmCluster):
    nodes: list[Node] = field(default_factory=list)

    @property
    def local(self) -> Path:
        """A node-local folder: the same path on every node, each node's own folder behind it."""
        return self.root / "local"

    @classmethod
    def start(cls, root: Path, *, timeout_s: float = 60) -> TwoNodeCluster:
        root = Path(root).resolve()
        nodes = make_nodes()
        env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        cluster = cls(root, nodes[0].name, env, prefix=nodes[0].exec, nodes=nodes)
        try:
            create_network(nodes)
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

    def _configure(self) -> None:
        for node in self.nodes:
            (self.root / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        self.local.mkdir(exist_ok=True)  # the mount point; each node binds its own folder over it
        _make_fake_gpus(GPUS_PER_NODE)
        head = self.nodes[0]
        text = config(self.root, ctld=f"{head.name}({head.addr})", nodes={n.name: n.addr for n in self.nodes},
                      ctld_port=PORTS[0], slurmd_port=PORTS[1], slurmd_timeout_s=SLURMD_TIMEOUT_S,
                      gpus=GPUS_PER_NODE)  # fmt: skip
        (self.root / "slurm.conf").write_text(text)
        names = ",".join(n.name for n in self.nodes)
        gres = f"NodeName={names} Name=gpu File=/dev/fakegpu[0-{GPUS_PER_NODE - 1}]\n"
        (self.root / "gres.conf").write_text(gres)

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
        own = {str(self.root / f"local-{node.name}"): str(self.local)}
        argv = node.daemon(_daemon("slurmd"), "-f", str(self.root / "slurm.conf"), "-N", node.name, binds=own)
        subprocess.run(argv, env=self.env, check=True, capture_output=True, timeout=30)
        self.pids[f"slurmd.{node.name}"] = _wait_pid(pid_file)

    def kill_node(self, i: int) -> list[int]:
        """A lost node: SIGKILL every process in node i's namespace (slurmd, job steps, ranks)."""
        self.pids.pop(f"slurmd.{self.nodes[i].name}", None)
        pids = netns_pids(self.nodes[i].netns)
        kill_all(pids)
        return pids

    def limit_link(self, i: int, *, rate: str) -> None:
        limit_link(self.nodes[i], rate=rate)

    def set_link(self, i: int, *, up: bool) -> None:
        set_link(self.nodes[i], up=up)

    def unlimit_link(self, i: int) -> None:
        unlimit_link(self.nodes[i])

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-p", "batch", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def stop(self) -> None:
        """Daemons by PID, then what is left in each namespace, then the namespaces, by name."""
        for name in [n for n in self.pids if n.startswith("slurmd.")] + ["slurmctld", "munged"]:
            pid = self.pids.pop(name, None)
            if pid:
                _stop_pid(pid)
        remove_network(self.nodes)
