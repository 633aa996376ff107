"""Fault matrix: each way a preemption, a hang or a lost rank reaches a bigclip job under a real
Slurm, and what happens. Writes benchmarks/results/faults.json (docs/scale-and-slurm.md renders its table).

    python benchmarks/faults.py [--concurrency 4] [--only NAME ...]      (as root, with slurm-wlm)

Starts a one-node Slurm (tests/support/slurm_cluster.py: Debian's slurm-wlm + munge, fake GPUs, a
`low` partition preempted by `high`), renders every job with `bigclip slurm` (tiny model, 2 CPU
ranks, demo data, a checkpoint every 8 steps), injects the fault once rank 0 has trained 5 steps,
and records: the signal the ranks saw first, the step they checkpointed, who requeued the job, the
step the rerun resumed at, whether every batch equals an uninterrupted run's (a reference job per
--workers value, run afterwards), and the seconds from the fault to the requeue and to the rerun's
first step. That last one includes Slurm's hold on a requeued job: cred_expire + 1 = 11 s here
(AuthInfo=cred_expire=10), 121 s with Slurm's default.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.launch_harness import read_keys  # noqa: E402
from support.slurm_cluster import SlurmCluster  # noqa: E402

from benchmarks.common import print_table, write_results  # noqa: E402
from benchmarks.faults_report import DELIVERY, Row, markdown, output, read_outcome  # noqa: E402
from bigclip.demo.shapes_data import write_demo_data  # noqa: E402
from bigclip.launch.slurm import main as slurm_main  # noqa: E402

TRIGGER_STEP, STEPS, AFTER_RESUME, ROW_TIMEOUT_S = 5, 40, 8, 480
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
MATRIX = [Row(*spec) for spec in [
    ("preempt", "srun", "fsdp", 2), ("preempt", "torchrun", "zero3", 8),
    ("requeue", "srun", "fsdp", 2), ("requeue", "torchrun", "zero3", 0),
    ("term-steps", "srun", "zero3", 8), ("term-steps", "torchrun", "fsdp", 2),
    ("time-limit", "srun", "fsdp", 0), ("time-limit", "torchrun", "zero3", 2),
    ("b-time-limit", "srun", "fsdp", 2), ("usr1-full", "srun", "zero3", 2),
    ("usr1-full", "torchrun", "fsdp", 8), ("usr1-batch", "srun", "fsdp", 2),
    ("term-batch", "torchrun", "fsdp", 2), ("cancel", "srun", "fsdp", 2),
    ("hang", "srun", "fsdp", 2), ("hang", "torchrun", "zero3", 2),
    ("kill", "srun", "fsdp", 2), ("kill", "torchrun", "fsdp", 2),
]]  # fmt: skip


def render(
    row_dir: Path,
    data: str,
    *,
    layout: str,
    engine: str,
    workers: int,
    steps: int,
    gres: bool = False,
    extra=(),
) -> Path:
    """The row's sbatch script: GPU GRES for preemption rows (the preemptor wants those GPUs)."""
    row_dir.mkdir(parents=True, exist_ok=True)
    gpus = ["--gpus-per-node", "2"] if gres else ["--gpus-per-node", "0", "--ranks-per-node", "2"]
    ds = (
        ["--engine", "deepspeed", "--deepspeed-config", str(ROOT / "ds_configs/zero3.json")]
        if engine == "zero3"
        else []
    )
    argv = [
        "--nodes", "1", *gpus, "--launcher", layout, "--cpus-per-gpu", "1", "--no-exclusive", "--python",
        sys.executable, "--signal-seconds", "60", "--checkpoint-seconds", "40", "--time", "00:10:00", *extra,
        "--model", "tiny", "--train-data", data, "--precision", "fp32", "--batch-size", "32", "--workers", str(workers),
        "--warmup", "2", "--epochs", "40", "--max-steps", str(steps), "--save-every-n-steps", "8", "--save-frequency",
        "0", "--log-every-n-steps", "8", "--local-loss", "--gather-with-grad", "--report-to", "", *ds,
        "--logs", str(row_dir / "logs"), "--name", "run", "--batch-keys-file", str(row_dir / "keys"),
        "-o", str(row_dir / "job.sbatch"),
    ]  # fmt: skip
    assert slurm_main(argv) == 0
    return row_dir / "job.sbatch"


def rank_pid(job_id: int, rank: int) -> int:
    """The rank's own process (not one of its forked data workers: those share its environment)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            env = dict(
                kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode().split("\0") if "=" in kv
            )
            cmd = (proc / "cmdline").read_bytes()
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        mine = env.get("RANK", env.get("SLURM_PROCID")) == str(rank) and b"bigclip.train" in cmd
        if mine and env.get("SLURM_JOB_ID") == str(job_id):
            found[int(proc.name)] = ppid
    ranks = [pid for pid, ppid in found.items() if ppid not in found]
    if len(ranks) != 1:
        raise RuntimeError(f"job {job_id}: rank {rank} not found exactly once: {sorted(found)}")
    return ranks[0]


def inject(cluster: SlurmCluster, row: Row, job_id: int) -> None:
    run = lambda *cmd: cluster.run(*cmd, check=False)  # noqa: E731
    f = row.fault
    if f == "preempt":
        run("sbatch", "-p", "high", "--gres=gpu:2", "--output=/dev/null", "--wrap", "sleep 1")
    elif f == "requeue":
        run("scontrol", "requeue", str(job_id))
    elif f == "cancel":
        run("scancel", str(job_id))
    elif f in ("term-steps", "usr1-full", "usr1-batch", "term-batch"):
        scope = {
            "term-steps": [],
            "usr1-full": ["--full"],
            "usr1-batch": ["--batch"],
            "term-batch": ["--batch"],
        }[f]
        run("scancel", *scope, f"--signal={'TERM' if 'term' in f else 'USR1'}", str(job_id))
    elif f in ("hang", "kill"):
        os.kill(rank_pid(job_id, 1), signal.SIGSTOP if f == "hang" else signal.SIGKILL)


@dataclass
class Running:
    row: Row
    dir: Path
    job_id: int
    started: float
    fault_at: float = 0.0  # wall clock, to compare with log timestamps
    requeued_at: float = 0.0
    ended_at: float = 0.0
    cancelled: bool = False


def start(cluster: SlurmCluster, row: Row, root: Path, data: str) -> Running:
    extra = ["--time", "00:02:00"] if row.endless else []
    extra += ["--step-timeout", "20"] if row.fault == "hang" else []
    steps = 100_000 if row.endless else STEPS
    script = render(root / row.name, data, layout=row.layout, engine=row.engine, workers=row.workers,
                    steps=steps, gres=row.fault == "preempt", extra=extra)  # fmt: skip
    options = ["-p", "low" if row.fault == "preempt" else "batch"]
    options += ["--signal=B:USR1@60"] * (row.fault == "b-time-limit")  # overrides the script's USR1@60
    return Running(row, script.parent, cluster.sbatch(script, *options, cwd=script.parent), time.time())


def poll(cluster: SlurmCluster, r: Running) -> bool:
    """Advance the row (inject, extend, cancel); True once it is over."""
    info = cluster.job(r.job_id)
    last = max(read_keys(r.dir / "keys", 0), default=-1)
    trigger = TRIGGER_STEP + 5 * (r.row.fault == "hang")  # past the step-8 checkpoint it resumes from
    if not r.fault_at and not r.row.endless and last >= trigger:
        inject(cluster, r.row, r.job_id)
        r.fault_at = time.time()
    if not r.requeued_at and int(info.get("Restarts", "0")) >= 1:
        r.requeued_at = time.time()
        if r.row.endless:  # the rerun gets time to show it resumed (the test's own change)
            cluster.run("scontrol", "update", f"JobId={r.job_id}", "TimeLimit=10", check=False)
    resumed = re.findall(r"resumed \S+ at step (\d+)", output(r.dir))
    if r.row.endless and not r.cancelled and resumed and last >= int(resumed[0]) + AFTER_RESUME:
        cluster.run("scancel", str(r.job_id), check=False)
        r.cancelled = True
    if time.time() - r.started > ROW_TIMEOUT_S:
        cluster.run("scancel", str(r.job_id), check=False)
        r.row.note = f"timed out after {ROW_TIMEOUT_S} s"
        return True
    if info.get("JobState") in FINAL:
        r.ended_at = time.time()
        return True
    return False


def compare_with_references(cluster: SlurmCluster, runs: list[Running], root: Path, data: str) -> None:
    """One uninterrupted run per --workers value, as long as the longest row; batches compared."""
    jobs = {}
    for workers in sorted({r.row.workers for r in runs}):
        steps = 1 + max(
            max(read_keys(r.dir / "keys", 0), default=0) for r in runs if r.row.workers == workers
        )
        script = render(root / f"reference-w{workers}", data, layout="srun", engine="fsdp", workers=workers,
                        steps=steps)  # fmt: skip
        jobs[workers] = cluster.sbatch(script, "-p", "batch", cwd=script.parent)
    for job in jobs.values():
        cluster.wait_for(
            job, lambda j: j.get("JobState") in FINAL, timeout_s=900, what="the reference finishing"
        )
    for r in runs:
        ref = root / f"reference-w{r.row.workers}" / "keys"
        pairs = [(read_keys(r.dir / "keys", k), read_keys(ref, k)) for k in range(2)]
        r.row.batches_equal = all(
            mine and all(ref_keys.get(s) == v for s, v in mine.items()) for mine, ref_keys in pairs
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--concurrency", type=int, default=4, help="Jobs at once (preemption rows: one at a time)."
    )
    parser.add_argument("--only", nargs="*", default=[], help="Row names (or parts of them) to run.")
    parser.add_argument("--markdown", action="store_true", help="Only print results/faults.json as Markdown.")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads((ROOT / "benchmarks/results/faults.json").read_text())["rows"]))
        return 0
    rows = [r for r in MATRIX if not args.only or any(part in r.name for part in args.only)]
    root = Path(tempfile.mkdtemp(prefix="bigclip-faults-"))
    data = write_demo_data(str(root / "data"), samples=1536, shards=4, val_samples=10, seed=0).train_pattern
    load_before = os.getloadavg()
    with SlurmCluster.start(root / "cluster") as cluster:
        cluster.env.update(PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
        runs = drive(cluster, rows, root, data, concurrency=args.concurrency)
        compare_with_references(cluster, runs, root, data)
    table = [{"name": r.name, "delivery": DELIVERY[r.fault], **asdict(r)} for r in rows]
    print_table(table, ["name", "outcome", "signal_seen", "stopped_step", "resumed_step", "requeued_by",
                        "seconds_to_requeue", "seconds_to_resume", "seconds_to_end", "batches_equal"])  # fmt: skip
    write_results("faults", table, slurm="Debian slurm-wlm 22.05, one node, proctrack/linuxproc, KillWait 30, "
                  "GraceTime 60, AuthInfo=cred_expire=10", load_average_before=load_before,
                  load_average_after=os.getloadavg(), work_dir=str(root))  # fmt: skip
    return 0


def drive(
    cluster: SlurmCluster, rows: list[Row], root: Path, data: str, *, concurrency: int
) -> list[Running]:
    pending, active, done = list(rows), [], []
    while pending or active:
        while pending and len(active) < concurrency:
            gres_busy = any(a.row.fault == "preempt" for a in active)
            nxt = next((r for r in pending if r.fault != "preempt" or not gres_busy), None)
            if nxt is None:
                break
            pending.remove(nxt)
            active.append(start(cluster, nxt, root, data))
            print(f"started {nxt.name} (job {active[-1].job_id})", flush=True)
        for r in list(active):
            if poll(cluster, r):
                state = cluster.job(r.job_id).get("JobState", "?")
                read_outcome(
                    r.row, r.dir, state, fault_at=r.fault_at, requeued_at=r.requeued_at, ended_at=r.ended_at
                )
                active.remove(r)
                done.append(r)
                print(f"finished {r.row.name}: {r.row.outcome}", flush=True)
        time.sleep(0.5)
    return done


if __name__ == "__main__":
    sys.exit(main())
