"""A real one-node Slurm (Debian's slurm-wlm + munge) in a private folder, for tests and benchmarks.

    with SlurmCluster.start(tmp_dir) as cluster:          # or: cluster = SlurmCluster.start(...)
        job = cluster.sbatch(script, partition="low")
        cluster.wait_state(job, "COMPLETED", timeout_s=120)

Everything lives under the folder: munged with its own key and socket, slurmctld and slurmd with
their own ports, state, spool, logs and PID files, so the cluster touches no system-wide Slurm or
munge set-up and two clusters can run side by side. Clients find it through SLURM_CONF (set in
`cluster.env`, which jobs inherit since sbatch exports the submitting environment). The daemons
are stopped by their PIDs (never by name).

The configuration is the one bigclip's Slurm tests need (see docs/scale-and-slurm.md, "Tested against a
real Slurm"): proctrack/linuxproc, task/none, cons_tres, JobRequeue=1, two fake GPUs as GRES
(/dev/fakegpuN made with mknod: count-only GRES is refused), partitions `low` (preemptable,
REQUEUE, GraceTime 60), `high` (a higher PriorityTier: its jobs preempt `low`'s) and `batch`
(never preempted), and `AuthInfo=cred_expire=10`: Slurm holds a requeued job PENDING
(Reason=BeginTime) for cred_expire + 1 seconds (120 by default; slurm.conf(5), AuthInfo).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

DAEMONS = ("munged", "slurmctld", "slurmd")
CPUS = 16  # declared (config_overrides): room for several 2-rank jobs at once on a 2-core box
GPUS = 2
REQUEUE_DELAY_S = 10  # AuthInfo cred_expire: a requeued job waits this + 1 s before it may start
KILL_WAIT_S = (
    30  # KillWait: from SIGTERM to SIGKILL when Slurm ends a job (and how long a node's slurmd takes at most)
)


SBIN = "/usr/sbin:/usr/bin:/sbin:/bin"


def _daemon(name: str) -> str:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN}") or name


def missing_reason() -> str:
    """Why a cluster cannot be started here ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (munged, slurmd and the fake GPU device nodes)"
    missing = [d for d in DAEMONS if _daemon(d) == d]
    if missing:
        how = "`make slurm-deps` installs them" if shutil.which("apt-get") else "and apt-get is not available"
        return f"{', '.join(missing)} not installed (Debian packages slurm-wlm, munge): {how}"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(
    root: Path,
    *,
    ctld: str,
    nodes: dict[str, str],
    ctld_port: int,
    slurmd_port: int,
    slurmd_timeout_s: int = 300,
    gpus: int = GPUS,
) -> str:
    """slurm.conf for `nodes` (name -> address, `gpus` fake GPUs each), slurmctld on `ctld`
    ("NAME(ADDRESS)"). The slurmd files are per node (%n) so several slurmds can share the folder
    (the two-node cluster)."""
    names = ",".join(nodes)
    node_lines = "".join(
        f"NodeName={name} NodeAddr={addr} CPUs={CPUS} RealMemory=8000 Gres=gpu:{gpus} State=UNKNOWN\n"
        for name, addr in nodes.items()
    )
    return f"""\
ClusterName=bigclip-test
SlurmctldHost={ctld}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={REQUEUE_DELAY_S}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdTimeout={slurmd_timeout_s}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait={KILL_WAIT_S}
MinJobAge=600
GresTypes=gpu
# Pending jobs that were not started on submission (a requeued job once its begin time passes)
# wait for the periodic passes: 60 s and 30 s by default, 2 s here so the tests do not idle.
# (A preemptor still takes ~20 s to signal its victim here: the tests must not race it.)
SchedulerParameters=sched_interval=2,bf_interval=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{node_lines}\
PartitionName=low Nodes={names} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=60 MaxTime=INFINITE State=UP
PartitionName=high Nodes={names} PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP
PartitionName=batch Nodes={names} PriorityTier=1 PreemptMode=OFF MaxTime=INFINITE State=UP
"""


def start_munged(folder: Path) -> int:
    """munged with its own key, socket and files under `folder`; returns its PID."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    subprocess.run(
        [_daemon("munged"), f"--socket={folder}/munge.socket", f"--key-file={key}",
         f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
         f"--seed-file={folder}/munged.seed", "--force"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return _read_pid(folder / "munged.pid")


@dataclass
class SlurmCluster:
    root: Path
    host: str
    env: dict[str, str]
    pids: dict[str, int] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # how client commands reach slurmctld

    @classmethod
    def start(cls, root: Path, *, timeout_s: float = 60) -> SlurmCluster:
        root = Path(root).resolve()
        host = socket.gethostname().split(".")[0]
        for sub in ("state", f"spool/{host}"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        _make_fake_gpus()
        (root / "slurm.conf").write_text(config(root, ctld=f"{host}(127.0.0.1)", nodes={host: "127.0.0.1"},
                                                ctld_port=_free_port(), slurmd_port=_free_port()))  # fmt: skip
        (root / "gres.conf").write_text(f"NodeName={host} Name=gpu File=/dev/fakegpu[0-{GPUS - 1}]\n")
        env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        cluster = cls(root, host, env)
        try:
            cluster._start_daemons()
            cluster._wait_idle(timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_daemons(self) -> None:
        self.pids["munged"] = start_munged(self.root / "munge")
        conf = str(self.root / "slurm.conf")
        subprocess.run([_daemon("slurmctld"), "-f", conf, "-i"], env=self.env, check=True, capture_output=True,
                       timeout=30)  # fmt: skip
        self.pids["slurmctld"] = _wait_pid(self.root / "slurmctld.pid")
        subprocess.run([_daemon("slurmd"), "-f", conf, "-N", self.host], env=self.env, check=True, capture_output=True,
                       timeout=30)  # fmt: skip
        self.pids["slurmd"] = _wait_pid(self.root / f"slurmd.{self.host}.pid")

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
            if states and all(state == "idle" for state in states):
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"the test cluster's node did not become idle in {timeout_s:.0f} s:\n{self.logs()}"
        )

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *cmd], env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)  # fmt: skip

    def sbatch(self, script: Path, *options: str, cwd: Path | None = None) -> int:
        done = subprocess.run([*self.prefix, "sbatch", "--parsable", *options, str(script)], env=self.env, cwd=cwd,
                              capture_output=True, text=True, check=True, timeout=30)  # fmt: skip
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (empty once the job has left slurmctld's memory)."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait_for(self, job_id: int, predicate, *, timeout_s: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if predicate(info):
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id}: {what} not within {timeout_s:.0f} s; last seen {info}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {name} (tail)\n" + "".join(_tail(self.root / name))
            for name in (
                "slurmctld.log",
                *(p.name for p in sorted(self.root.glob("slurmd.*.log"))),
                "munge/munged.log",
            )
        )

    def stop(self) -> None:
        """Stop the daemons by PID (slurmd, slurmctld, then munged); SIGKILL what outlives 10 s."""
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid:
                _stop_pid(pid)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the test cluster (the message says why)."""


def _make_fake_gpus(count: int = GPUS) -> None:
    for i in range(count):
        path = Path(f"/dev/fakegpu{i}")
        if path.exists():
            continue
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a character device like /dev/null
        except OSError as e:
            raise ClusterUnavailable(
                f"cannot create the fake GPU device {path} ({e}): no CAP_MKNOD here"
            ) from e


def _read_pid(path: Path) -> int:
    return int(path.read_text().split()[0])


def _wait_pid(path: Path, timeout_s: float = 20) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return _read_pid(path)
        time.sleep(0.1)
    raise RuntimeError(f"{path} did not appear: the daemon did not start (see its log beside it)")


def _stop_pid(pid: int, timeout_s: float = 10) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 30) -> list[str]:
    if not path.exists():
        return [f"({path} missing)\n"]
    return path.read_text(errors="replace").splitlines(keepends=True)[-lines:]


Cluster = TypeVar("Cluster")


def start_for_tests(start: Callable[[], Cluster], *, reason: str, what: str) -> Cluster:
    """`start()` unless `reason` says it cannot run here; then skip saying why, or fail under CI
    (which must run `what`). The jobs the cluster runs import this checkout's bigclip."""
    try:
        cluster = None if reason else start()
    except ClusterUnavailable as e:
        reason = str(e)
    if reason:
        import pytest  # only the tests call this; benchmarks use the cluster without pytest

        if os.environ.get("CI"):
            pytest.fail(f"CI must run {what}: {reason} (make slurm-deps installs Slurm)")
        pytest.skip(f"cannot run {what} here: {reason}")
    root = Path(__file__).resolve().parents[2]
    cluster.env["PYTHONPATH"] = os.pathsep.join([str(root), cluster.env.get("PYTHONPATH", "")])
    cluster.env["PYTHONWARNINGS"] = "ignore"
    return cluster
