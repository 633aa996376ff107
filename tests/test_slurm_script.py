"""The rendered sbatch script's own logic, run by bash under stand-ins for srun and scontrol (no
Slurm needed; tests/test_slurm_cluster.py runs the same scripts under a real one):
signals to the batch shell are passed on to the launcher and never kill the shell; the job is
requeued once, by the script only when Slurm did not already, and never after a cancel; and, end
to end on 2 CPU ranks, the rerun resumes at the preempted step."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bigclip.launch.slurm import main as slurm_main

ROOT = Path(__file__).resolve().parents[1]

FAKE_RANKS = """#!{python}
# The launcher's part: record the first signal, write the requeue marker as the ranks would, exit 85.
import json, os, pathlib, signal, sys, time
args = sys.argv[1:]
run_dir = pathlib.Path(args[args.index("--logs") + 1]) / args[args.index("--name") + 1]
got = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
pathlib.Path(os.environ["SRUN_PID_FILE"]).write_text(str(os.getpid()))
while not got:
    time.sleep(0.02)
marker = run_dir / f"requeue-{{os.environ['SLURM_JOB_ID']}}.json"
marker.write_text(json.dumps({{"step": 7, "signal": got[0], "reason": "preempted"}}))
pathlib.Path(os.environ["SRUN_SIGNALS"]).write_text(",".join(got))
time.sleep(float(os.environ.get("SRUN_LINGERS_S", 0)))  # srun waiting for the step's teardown
sys.exit(85)
"""
REFUSED_RANKS = """#!/bin/bash
# The launcher's part in a job the run's lock refuses (another job holds LOGS/NAME): exit 1, no marker.
echo "bigclip: LOGS/NAME is in use by another job" >&2
exit 1
"""
REAL_SRUN = """#!{python}
# srun's part: start SLURM_NTASKS copies of the command with SLURM_PROCID/LOCALID set and forward
# SIGUSR1/SIGTERM to them (as srun does); exit with the highest task exit code.
import os, signal, subprocess, sys
args = [a for a in sys.argv[1:]]
while args and args[0].startswith("--"):
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
procs = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}})
         for r in range(n)]
forward = lambda sig, frame: [p.send_signal(sig) for p in procs]
signal.signal(signal.SIGUSR1, forward)
signal.signal(signal.SIGTERM, forward)
open(os.environ["SRUN_PID_FILE"], "w").write(str(os.getpid()))
sys.exit(max(p.wait() for p in procs))
"""
STAND_IN_SCONTROL = """#!/bin/bash
# scontrol's part: one host; `show job` prints $JOB_LINE_FILE; requeues are recorded and answer
# with $REQUEUE_RC (a requeue that Slurm performed although scontrol died bumps Restarts).
case "$1 $2" in
    "show hostnames") echo 127.0.0.1 ;;
    "show job") cat "$JOB_LINE_FILE" ;;
    "requeue "*) echo "requeue $2" >> "$SCONTROL_LOG"
        if [[ -n "${REQUEUE_BUMPS:-}" ]]; then sed -i 's/Restarts=0/Restarts=1/' "$JOB_LINE_FILE"; fi
        exit "${REQUEUE_RC:-0}" ;;
esac
"""


def render(tmp_path: Path, *argv: str) -> Path:
    out = tmp_path / "job.sbatch"
    assert slurm_main([*argv, "-o", str(out), "--force"]) == 0
    return out


def _stand_ins(bin_dir: Path, srun: str) -> None:
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(srun.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(STAND_IN_SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)


def _free_port_between(low: int, high: int) -> int:
    for port in random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def _job_env(tmp_path: Path, restart: int, job_line: str = "") -> dict[str, str]:
    # The script's MASTER_PORT is 20000 + SLURM_JOB_ID % 20000: pick a job id that makes it a free port.
    job_id = _free_port_between(20000, 40000) - 20000
    line = job_line or "JobState=RUNNING Reason=None Restarts={restart}"
    (tmp_path / "job_line").write_text(
        f"JobId={job_id} JobName=x {line.format(restart=restart)} Dependency=(null)\n"
    )
    return {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_NTASKS": "2", "SLURM_RESTART_COUNT": str(restart), "PYTHONWARNINGS": "ignore",
            "SRUN_PID_FILE": str(tmp_path / "srun.pid"), "SRUN_SIGNALS": str(tmp_path / "srun.signals"),
            "SCONTROL_LOG": str(tmp_path / "scontrol.log"), "JOB_LINE_FILE": str(tmp_path / "job_line")}  # fmt: skip


def _fake_job(tmp_path: Path, *extra: str, ranks: str = FAKE_RANKS) -> Path:
    _stand_ins(tmp_path / "bin", ranks)
    return render(tmp_path, "--nodes", "1", "--gpus-per-node", "2", "--model", "tiny", "--train-data",
                  "/data/{0..3}.tar", "--logs", str(tmp_path / "logs"), "--name", "job", *extra)  # fmt: skip


def _run_signalled(script: Path, env: dict[str, str], tmp_path: Path, sig: signal.Signals) -> str:
    """Start the script, signal the batch shell once the launcher runs, return its output (a file,
    as Slurm's: a launcher that outlives the shell keeps no pipe open)."""
    log = tmp_path / "job.out"
    with log.open("w") as out:
        shell = subprocess.Popen(
            ["bash", str(script)], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun.pid").exists():
        assert time.monotonic() < deadline and shell.poll() is None, log.read_text()
        time.sleep(0.05)
    shell.send_signal(sig)
    shell.wait(timeout=30)
    assert shell.returncode == 0, log.read_text()  # the shell survived its signal and exits cleanly
    return log.read_text()


def _requeues(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().split() if log.exists() else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_the_batch_shell_reaches_the_ranks_and_the_job_requeues_once(tmp_path: Path, sig) -> None:
    script = _fake_job(tmp_path)
    env = _job_env(tmp_path, 0)
    out = _run_signalled(script, env, tmp_path, sig)
    assert (tmp_path / "srun.signals").read_text() == "SIGUSR1"  # passed on through the launcher
    assert f"{sig.name} received; asking the ranks to checkpoint" in out
    assert _requeues(tmp_path) == ["requeue", env["SLURM_JOB_ID"]]
    assert "requeued job" in out and '"step": 7' in out


@pytest.mark.parametrize(
    ("job_line", "requeue_rc", "bumps", "expected", "requeued"),
    [
        ("JobState=COMPLETING Reason=None Restarts={restart}", 0, False, "the job is ending", False),
        ("JobState=COMPLETING Reason=TimeLimit Restarts={restart}", 0, False, "requeued job", True),
        (
            "JobState=COMPLETING Reason=None Restarts=1",
            0,
            False,
            "SLURM has requeued this job already",
            False,
        ),
        ("JobState=RUNNING Reason=None Restarts={restart}", 143, True, "requeued job", True),
        ("JobState=RUNNING Reason=None Restarts={restart}", 1, False, "scontrol requeue failed", True),
    ],
    ids=["cancelled", "time-limit", "requeued-by-slurm", "scontrol-killed-by-its-requeue", "requeue-fails"],
)
def test_the_script_requeues_only_when_nobody_else_did_and_never_a_cancelled_job(
    tmp_path: Path, job_line: str, requeue_rc: int, bumps: bool, expected: str, requeued: bool
) -> None:
    script = _fake_job(tmp_path)
    env = _job_env(tmp_path, 0, job_line) | {"REQUEUE_RC": str(requeue_rc), "REQUEUE_BUMPS": "1" * bumps}
    out = _run_signalled(script, env, tmp_path, signal.SIGTERM)
    assert f"bigclip sbatch: {expected}" in out, out
    assert _requeues(tmp_path) == (["requeue", env["SLURM_JOB_ID"]] if requeued else [])


@pytest.mark.parametrize(("whose", "kept"), [("another job's", True), ("this job's earlier run's", False)])
def test_a_job_leaves_and_ignores_the_requeue_marker_of_another_job_of_the_same_name(
    tmp_path: Path, whose: str, kept: bool
) -> None:
    """Two jobs given one --name: the second's ranks are refused by the run's lock. The first job's
    marker (its stop, which its own script is about to read) stays, and the second job does not
    requeue itself on it; a marker left by this job's earlier run (a requeue keeps the job id) is
    cleared before the launch."""
    script = _fake_job(tmp_path, ranks=REFUSED_RANKS)
    env = _job_env(tmp_path, 0)
    job = int(env["SLURM_JOB_ID"]) + (1 if kept else 0)
    marker = tmp_path / "logs" / "job" / f"requeue-{job}.json"
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"step": 7, "signal": "SIGUSR1", "reason": "preempted"}))
    job_run = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert job_run.returncode == 1, job_run.stdout + job_run.stderr
    assert marker.exists() == kept, whose
    assert "asked for a requeue" not in job_run.stdout and _requeues(tmp_path) == [], job_run.stdout


def test_a_cancelled_job_says_so_while_srun_still_waits_for_its_step(tmp_path: Path) -> None:
    """After scancel, srun can wait for the step's teardown until KillWait runs out, when Slurm
    SIGKILLs the batch shell too: the shell says where the ranks stopped, and that the job is not
    requeued, once the marker is there, without waiting for srun."""
    script = _fake_job(tmp_path)
    env = _job_env(tmp_path, 0, "JobState=CANCELLED Reason=None Restarts={restart}") | {
        "SRUN_LINGERS_S": "600"
    }
    try:
        out = _run_signalled(script, env, tmp_path, signal.SIGTERM)
    finally:
        os.kill(int((tmp_path / "srun.pid").read_text()), signal.SIGKILL)
    stopped = out.index('bigclip sbatch: the ranks stopped and asked for a requeue ({"step": 7')
    assert out.index("bigclip sbatch: the job is ending (CANCELLED") > stopped, out
    assert _requeues(tmp_path) == []


@pytest.mark.parametrize(("restarts", "requeued"), [(1, True), (2, False)])
def test_the_script_stops_requeueing_after_its_cap(tmp_path: Path, restarts: int, requeued: bool) -> None:
    """--max-requeues 2: the job's third run (SLURM_RESTART_COUNT 2) asks for a requeue and gets a
    line saying it is not requeued, and why; its second run is still requeued."""
    script = _fake_job(tmp_path, "--max-requeues", "2")
    assert "# Requeue cap: 2 (--max-requeues)" in script.read_text()
    env = _job_env(tmp_path, restarts)
    out = _run_signalled(script, env, tmp_path, signal.SIGUSR1)
    capped = "bigclip sbatch: not requeueing: this job has been requeued 2 times, the cap (--max-requeues 2)"
    assert (capped in out) != requeued, out
    assert _requeues(tmp_path) == (["requeue", env["SLURM_JOB_ID"]] if requeued else [])


def test_the_requeue_cap_follows_the_planned_length_of_the_run(tmp_path: Path) -> None:
    """Without --max-requeues: MIN_REQUEUE_CAP, or twice the job runs the plan needs when more."""
    from bigclip.launch.slurm_job import MIN_REQUEUE_CAP

    base = ["--nodes", "1", "--gpus-per-node", "8", "--model", "tiny", "--train-data", "/data/{0..3}.tar",
            "--logs", str(tmp_path / "logs")]  # fmt: skip
    short = render(tmp_path, *base, "--train-num-samples", "1000").read_text()
    assert f"# Requeue cap: {MIN_REQUEUE_CAP} (the default; the plan needs" in short
    long = render(tmp_path, *base, "--train-num-samples", "1000000000000", "--time", "00:20:00").read_text()
    runs = int(re.search(r": (\d+) run\(s\) of 00:20:00\)", long).group(1))
    assert runs > MIN_REQUEUE_CAP and f"# Requeue cap: {2 * runs} (twice the runs the plan needs" in long
    assert f"MAX_REQUEUES={2 * runs}\n" in long


def test_a_signal_before_the_launch_requeues_without_starting_the_ranks(tmp_path: Path) -> None:
    script = _fake_job(tmp_path, "--setup", "sleep 2")
    env = _job_env(tmp_path, 0)
    shell = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    time.sleep(0.5)
    shell.send_signal(signal.SIGUSR1)  # e.g. #SBATCH --signal=B:USR1@N arriving early
    out, _ = shell.communicate(timeout=30)
    assert shell.returncode == 0 and "SIGUSR1 before the ranks started: nothing to checkpoint" in out, out
    assert not (tmp_path / "srun.pid").exists() and _requeues(tmp_path) == ["requeue", env["SLURM_JOB_ID"]]


def _steps_logged(keys_prefix: Path) -> int:
    path = Path(f"{keys_prefix}.rank0.jsonl")
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines()), default=0)


@pytest.mark.slow
@pytest.mark.dist
def test_preempted_job_checkpoints_requeues_itself_and_resumes(tmp_path: Path, demo_data) -> None:
    """The rendered script under stand-ins for srun and scontrol, 2 CPU ranks: SIGUSR1 -> checkpoint,
    requeue.json, `scontrol requeue`; the rerun (what SLURM starts after a requeue) resumes there."""
    _stand_ins(tmp_path / "bin", REAL_SRUN)
    keys = tmp_path / "keys"
    script = render(
        tmp_path, "--nodes", "1", "--gpus-per-node", "2", "--cpus-per-gpu", "2", "--python", sys.executable,
        "--model", "tiny", "--train-data", demo_data.train_pattern, "--precision", "fp32", "--batch-size", "32",
        "--workers", "1", "--epochs", "1", "--warmup", "2", "--log-every-n-steps", "2", "--logs", str(tmp_path / "logs"),
        "--local-loss", "--gather-with-grad", "--batch-keys-file", str(keys), "--report-to", "",
    )  # fmt: skip
    env = _job_env(tmp_path, 0)
    first = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while _steps_logged(keys) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(int((tmp_path / "srun.pid").read_text()), signal.SIGUSR1)
    out1, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out1[-3000:]
    marker = json.loads((tmp_path / f"logs/tiny-fsdp-2gpu/requeue-{env['SLURM_JOB_ID']}.json").read_text())
    assert marker["signal"] == "SIGUSR1" and marker["step"] >= 3
    assert _requeues(tmp_path) == ["requeue", env["SLURM_JOB_ID"]]
    rerun = _job_env(tmp_path, 1) | {"SLURM_JOB_ID": env["SLURM_JOB_ID"]}  # a requeued job keeps its id
    second = subprocess.run(["bash", str(script)], env=rerun, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert second.returncode == 0, second.stdout[-3000:]
    resumed = re.search(r"resumed \S+ at step (\d+)", second.stdout)
    assert resumed and int(resumed.group(1)) == marker["step"], second.stdout[-3000:]
    assert not list((tmp_path / "logs/tiny-fsdp-2gpu").glob("requeue*"))  # finished: nothing to requeue
    assert len(_requeues(tmp_path)) == 2  # still the one requeue
