"""A word for every long wait, one schedule horizon (issue 38, items 3 and 4), through the real
`bigclip train` process.

Stop signals in each phase of a run's life, each held open for real rather than raced: S3 (the
loopback server behind tests/support/s3_fault_proxy.py) holds a request of start-up, of the
checkpoint read or of the first batch until the test releases it, and --torchcompile's first
graph takes minutes on a CPU. Every wait is derived from the process's own lines ("X: started")
and the proxy's (a request held), never from a sleep sized for this machine. The line saying
what the run does must come while the phase is still held, and the exit code is the documented
85 (requeue). Then the horizon: a run with --epochs and a --max-steps it never reaches logs and
decays to where it really ends, and its resume with more epochs notes the LR jump.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from support.launch_harness import LAUNCHER_VARIABLES, srun_like, wait_all
from support.s3_fault_proxy import FaultProxy

from bigclip.cli_args import parse_train_args
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.train.preemption import REQUEUE_EXIT_CODE
from bigclip.train.schedule import lr_at
from bigclip.train.signals import GRACE_ENV

pytestmark = [pytest.mark.dist, pytest.mark.slow]
BUCKET = "stop-signals"
STEPS_PER_EPOCH = 8  # --train-num-samples 256 at --batch-size 32
WAIT_S = 300  # an upper bound for a phase to be reached on a loaded machine, never a sleep


def no_launcher_env() -> dict[str, str]:
    """This process's environment without a launcher's rank variables (the test sets its own)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}


class Watched:
    """A `bigclip train` process whose output lines the test reads as they come."""

    def __init__(self, argv: list[str], *, endpoint: str) -> None:
        env = (
            no_launcher_env()
            | {"OMP_NUM_THREADS": "1"}
            | ({"AWS_ENDPOINT_URL": endpoint} if endpoint else {})
        )
        self.proc = subprocess.Popen([sys.executable, "-m", "bigclip", "train", *argv], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, text: str, *, timeout_s: float = WAIT_S) -> str:
        """The first line (already seen or to come) containing `text`."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if text in line:
                    return line
            seen = len(self.lines)
            try:
                if self._new.get(timeout=max(0.0, deadline - time.monotonic())) is None and not any(
                    text in line for line in self.lines[seen:]
                ):
                    raise AssertionError(f"exited {self.proc.wait()} before {text!r}:\n" + self.tail())
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout_s} s:\n" + self.tail()) from None

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def exit_code(self, timeout_s: float = WAIT_S) -> int:
        return self.proc.wait(timeout=timeout_s)

    def tail(self) -> str:
        return "\n".join(self.lines[-40:])


@pytest.fixture(scope="module")
def s3(demo_data):
    """The loopback S3, with the demo shards uploaded (for a first batch the proxy can hold)."""
    with LoopbackS3() as server:
        server.create_bucket(BUCKET)
        train = Path(demo_data.train_pattern.split("{")[0])
        for path in sorted(train.iterdir()):
            server.client().upload_file(str(path), BUCKET, f"data/{path.name}")
        yield server


@pytest.fixture
def proxy(s3):
    with FaultProxy(upstream=s3.endpoint) as p:
        yield p


def train_argv(demo_data, logs: Path, endpoint: str, prefix: str, *extra: str) -> list[str]:
    return [
        "--model", "tiny", "--train-data", demo_data.train_pattern, "--train-num-samples", "256",
        "--precision", "fp32", "--batch-size", "32", "--workers", "1", "--lr", "2e-3", "--warmup", "3",
        "--log-every-n-steps", "1", "--logs", str(logs), "--name", "run", "--s3-endpoint", endpoint,
        "--checkpoint-dir", f"s3://{BUCKET}/{prefix}/checkpoints", "--save-frequency", "1", *extra,
    ]  # fmt: skip


def assert_stopped_before_training(run: Watched, said: str, *, phase: str, logs: Path | None) -> None:
    assert f"received during {phase}: no step taken since the run started, nothing to checkpoint; exiting " \
           f"now with {REQUEUE_EXIT_CODE} (requeue)" in said  # fmt: skip
    assert run.exit_code() == REQUEUE_EXIT_CODE, run.tail()
    assert "Traceback" not in "\n".join(run.lines), run.tail()
    if logs is not None:  # the run folder exists: the marker makes the sbatch script requeue
        marker = json.loads((logs / "run" / "requeue.json").read_text())
        assert marker["reason"] == f"stopped during {phase}: nothing trained to checkpoint"


def test_the_horizon_and_stops_during_start_up_and_the_checkpoint_read(demo_data, tmp_path, s3, proxy):
    """1. --epochs 2 --max-steps 100: the log, the ETA and the LR count to step 16, where the
    epochs end the run. 2. SIGTERM while start-up waits for S3 (a manifest read held), and
    3. SIGUSR1 while the checkpoint is read (its data held): each said at once, exit 85, the
    marker left. 4. The resume with --epochs 3 notes the LR jump."""
    prefix, logs = uuid.uuid4().hex[:8], tmp_path / "logs"

    def argv(*extra: str) -> list[str]:
        return train_argv(demo_data, logs, proxy.endpoint, prefix, *extra)

    first = Watched(argv("--epochs", "2", "--max-steps", "100"), endpoint=proxy.endpoint)
    assert first.exit_code() == 0, first.tail()
    end = 2 * STEPS_PER_EPOCH
    first.wait_for(
        f"schedule: steps 0 to {end} (--epochs 2 x {STEPS_PER_EPOCH} steps; --max-steps 100 is not reached)"
    )
    last = first.wait_for(f"Train Epoch: 1 [{STEPS_PER_EPOCH * 32}/{STEPS_PER_EPOCH * 32} (100%)]")
    optim = parse_train_args(argv("--epochs", "2", "--max-steps", "100")).optim
    assert f"LR: {lr_at(end - 1, optim, end):5f} " in last and "ETA: 0s" in last, last
    assert lr_at(end - 1, optim, end) < 0.02 * optim.lr < lr_at(end - 1, optim, 100)  # what 100 would give

    proxy.add_rule("stall", method="GET", path_contains="/manifest.json")  # start-up reads it first
    starting = Watched(argv("--epochs", "3", "--resume", "latest"), endpoint=proxy.endpoint)
    starting.wait_for("start-up: started")
    assert proxy.stalled.wait(timeout=WAIT_S), starting.tail()
    starting.signal(signal.SIGTERM)
    said = starting.wait_for("SIGTERM received during")  # while S3 still holds the request
    assert starting.proc.poll() is None
    proxy.release()
    assert_stopped_before_training(starting, said, phase="start-up", logs=logs)

    with FaultProxy(upstream=s3.endpoint) as reading_proxy:  # a fresh hold (release is for good)
        reading_proxy.add_rule("stall", method="GET", path_contains=".distcp")
        reading = Watched(train_argv(demo_data, logs, reading_proxy.endpoint, prefix, "--epochs", "3", "--resume",
                                     "latest"), endpoint=reading_proxy.endpoint)  # fmt: skip
        reading.wait_for("reading checkpoint s3://")
        assert reading_proxy.stalled.wait(timeout=WAIT_S), reading.tail()
        reading.signal(signal.SIGUSR1)
        said = reading.wait_for("SIGUSR1 received during")
        assert reading.proc.poll() is None
        reading_proxy.release()
        phase = said.split("received during ")[1].split(": no step taken")[0]
        assert phase.startswith("reading checkpoint s3://") and phase.endswith(f"step_{end:08d}")
        assert_stopped_before_training(reading, said, phase=phase, logs=logs)

    resumed = Watched(argv("--epochs", "3", "--resume", "latest", "--max-steps", str(end + 1)),
                      endpoint=proxy.endpoint)  # fmt: skip
    assert resumed.exit_code() == 0, resumed.tail()
    note = resumed.wait_for("LR schedule on resume:")
    before, after = lr_at(end - 1, optim, end), lr_at(end, optim, end + 1)
    assert f"the run now ends at step {end + 1} (--max-steps {end + 1}; --epochs 3 x {STEPS_PER_EPOCH} steps is " \
           f"not reached), the checkpoint's run at step {end}" in note  # fmt: skip
    assert f"the LR jumps from {before:.3g} (step {end}, the checkpoint's last) to {after:.3g}" in note
    assert "WARNING" in note and math.isclose(after, optim.lr * 0.5 * (1 + math.cos(math.pi * 13 / 14)))


def test_a_stop_at_one_rank_alone_during_the_checkpoint_read_still_requeues(demo_data, tmp_path, s3, proxy):
    """SIGTERM to rank 1 alone while its part of the checkpoint is read (a kill that Slurm retries
    at a node that answers again reaches the rerun of the same job id there, on that node only):
    rank 1 exits 85 and leaves the requeue marker itself, so the sbatch script, which trusts the
    marker, requeues the job rather than ending it FAILED (only rank 0 used to leave the marker).
    Rank 0's next collective fails: it names rank 1's stop as the cause, not only "Connection
    closed by peer", and exits 85 too."""
    prefix, logs = uuid.uuid4().hex[:8], tmp_path / "logs"
    argv = train_argv(demo_data, logs, proxy.endpoint, prefix, "--epochs", "1", "--max-steps", "2")
    env = {"AWS_ENDPOINT_URL": proxy.endpoint}
    assert wait_all(srun_like(argv, 2, tmp_path, env=env)) == [0, 0]
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/checkpoints/")["Contents"]
    rank1 = next(o["Key"] for o in listed if o["Key"].endswith(".distcp") and "/__1_" in o["Key"])
    proxy.add_rule("stall", method="GET", path_contains=rank1.rsplit("/", 1)[1])
    (logs / "run" / "requeue.json").unlink(missing_ok=True)
    ranks = srun_like([*argv[: argv.index("--max-steps")], "--max-steps", "4", "--resume", "latest"], 2, tmp_path,
                      env=env)  # fmt: skip
    assert proxy.stalled.wait(timeout=WAIT_S), (tmp_path / "rank1.log").read_text()[-3000:]
    ranks[1].send_signal(signal.SIGTERM)
    proxy.release()
    codes = wait_all(ranks, timeout_s=WAIT_S)
    rank0_log, rank1_log = ((tmp_path / f"rank{r}.log").read_text() for r in (0, 1))
    assert codes == [REQUEUE_EXIT_CODE] * 2, (codes, rank0_log[-3000:], rank1_log[-3000:])
    marker = json.loads((logs / "run" / "requeue.json").read_text())
    assert marker["signal"] == "SIGTERM" and marker["reason"].startswith(
        "stopped during reading checkpoint s3://"
    )
    said = rank0_log.rstrip().splitlines()[-1]
    assert (
        f": rank 1 on {socket.gethostname()} received SIGTERM and left first (stopped during reading" in said
    ), said
    assert "so this rank's set-up failed: loading s3://" in said and said.endswith(
        "exiting with 85 (requeue)"
    ), said


def test_a_stop_at_one_rank_alone_at_the_rendezvous_leaves_the_marker(demo_data, tmp_path):
    """SIGTERM to rank 1 while it waits at the rendezvous for rank 0's store (a kill that Slurm
    retries at a node that answers again reaches the rerun's ranks there as they start): it exits
    85 and leaves the requeue marker in the run folder the sbatch script made. srun's own exit code
    is not 85 once it has killed the other node's ranks, so without the marker the job ended FAILED
    instead of being requeued."""
    logs = tmp_path / "logs"
    (logs / "run").mkdir(parents=True)  # as the sbatch script makes it before srun
    argv = ["--model", "tiny", "--train-data", demo_data.train_pattern, "--train-num-samples", "256",
            "--batch-size", "32", "--workers", "1", "--logs", str(logs), "--name", "run"]  # fmt: skip
    with socket.create_server(("127.0.0.1", 0)) as store:  # rank 0's store, which never answers
        port = str(store.getsockname()[1])
        env = no_launcher_env() | {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                                   GRACE_ENV: "5"}  # fmt: skip
        rank1 = subprocess.Popen([sys.executable, "-m", "bigclip.train", *argv], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        store.settimeout(WAIT_S)
        connection, _ = store.accept()  # rank 1 has reached the rendezvous
        with connection:
            rank1.send_signal(signal.SIGTERM)
            out, _ = rank1.communicate(timeout=WAIT_S)
    assert rank1.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    marker = json.loads((logs / "run" / "requeue.json").read_text())
    assert marker["signal"] == "SIGTERM" and marker["rank"] == 1, marker
    assert marker["reason"] == "stopped during start-up: nothing trained to checkpoint", marker


# `python -m bigclip.train FLAGS` with a SIGTERM that came while its entry was still importing:
# bigclip.train.__main__ has blocked it, so it is delivered as the handlers go in.
SIGNAL_BEFORE_THE_HANDLERS = """
import os, runpy, signal, sys
from bigclip.train.signals import SignalFlag
install = SignalFlag.install
def install_after_a_signal(self):
    if not self._previous:
        os.kill(os.getpid(), signal.SIGTERM)
    return install(self)
SignalFlag.install = install_after_a_signal
sys.argv = ["bigclip.train", *sys.argv[1:]]
runpy.run_module("bigclip.train", run_name="__main__", alter_sys=True)
"""


def test_a_stop_before_the_flags_are_read_leaves_the_marker(demo_data, tmp_path):
    """A signal that waited for the handlers (it came while the entry imported) stops the rank
    before its flags are read: it still leaves the marker in LOGS/NAME."""
    logs = tmp_path / "logs"
    (logs / "run").mkdir(parents=True)
    argv = ["--model", "tiny", "--train-data", demo_data.train_pattern, "--logs", str(logs), "--name", "run"]
    done = subprocess.run([sys.executable, "-c", SIGNAL_BEFORE_THE_HANDLERS, *argv], env=no_launcher_env(),
                          text=True, capture_output=True, timeout=WAIT_S)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == REQUEUE_EXIT_CODE and "SIGTERM received during start-up" in out, out[-3000:]
    marker = json.loads((logs / "run" / "requeue.json").read_text())
    assert marker["reason"] == "stopped during start-up: nothing trained to checkpoint", marker


def test_a_stop_during_the_first_step_while_it_waits_for_data(demo_data, tmp_path, s3, proxy):
    """The first batch's shard read held by S3: SIGTERM is said at once and the rank leaves
    without waiting for the data (nothing trained yet)."""
    pattern = f"s3://{BUCKET}/data/" + Path(demo_data.train_pattern).name
    argv = [*train_argv(demo_data, tmp_path, proxy.endpoint, uuid.uuid4().hex[:8], "--epochs", "1")]
    argv[argv.index("--train-data") + 1] = pattern
    proxy.add_rule("stall", method="GET", path_contains=".tar")
    run = Watched(argv, endpoint=proxy.endpoint)
    run.wait_for("the first step: started")
    assert proxy.stalled.wait(timeout=WAIT_S), run.tail()
    run.signal(signal.SIGTERM)
    said = run.wait_for("SIGTERM received during")
    assert_stopped_before_training(run, said, phase="the first step", logs=tmp_path)  # the shard still held
    proxy.release()


def test_a_stop_while_torch_compile_compiles_the_first_step(demo_data, tmp_path):
    """--torchcompile (inductor): the first step says it compiles; SIGINT during the first
    graph's compilation is said at once and ends the rank without waiting for the compile."""
    argv = train_argv(demo_data, tmp_path, "", "", "--epochs", "1", "--torchcompile")
    argv = argv[: argv.index("--s3-endpoint")] + argv[argv.index("--epochs") :]  # a local run
    run = Watched(argv, endpoint="")
    assert "--torchcompile: this step also compiles" in run.wait_for("the first step: started")
    run.wait_for("torch.compile: compiling graph 1")
    run.signal(signal.SIGINT)
    said = run.wait_for("SIGINT received during")
    assert_stopped_before_training(run, said, phase="the first step", logs=tmp_path)
    assert not any("graph 1 compiled in" in line for line in run.lines), run.tail()  # it did not wait
