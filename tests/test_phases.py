"""A word for every long wait, and a stop signal answered at once (issue 38, item 3), in units:
the phase lines and heartbeats (phases.py), and the stop watcher (signals.py) in a small process
that imports no torch, its main thread held in C code the way a stalled read or a collective
holds a rank. A real `bigclip train` signalled in each phase: test_stop_signals.py."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bigclip.train import phases
from bigclip.train.phases import HEARTBEAT_S, QUIET_S, OnStop
from bigclip.train.signals import SignalFlag, write_requeue_marker

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def said(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(phases, "say", lambda text, level=0: lines.append(text))
    phases.reset()
    yield lines
    phases.reset()


def test_an_announced_phase_says_start_heartbeats_and_end(said):
    opened = phases.begin("reading checkpoint X", on_stop=OnStop.EXIT_NOW, detail="41 MB",
                          progress=lambda: "3 of 4 files")  # fmt: skip
    t0 = opened.started
    assert said == ["reading checkpoint X: started (41 MB)"]
    assert phases.heartbeat(t0 + HEARTBEAT_S - 1) is None
    assert (
        phases.heartbeat(t0 + HEARTBEAT_S) == "reading checkpoint X: still running after 60 s (3 of 4 files)"
    )
    assert phases.heartbeat(t0 + HEARTBEAT_S + 1) is None  # the next one a heartbeat later
    assert phases.heartbeat(t0 + 2 * HEARTBEAT_S).startswith(
        "reading checkpoint X: still running after 120 s"
    )
    opened.end()
    assert said[-1].startswith("reading checkpoint X: done in ") and said[-1].endswith("s (3 of 4 files)")
    assert phases.current() is None and phases.current_name() == "start-up"


def test_a_quiet_phase_speaks_only_when_it_takes_long(said):
    quick = phases.begin("waiting for the upload", announce=False, quiet_s=QUIET_S)
    quick.end()
    assert said == []  # a quick one says nothing at all
    slow = phases.begin("waiting for the upload", announce=False, quiet_s=QUIET_S)
    assert phases.heartbeat(slow.started + QUIET_S - 0.5) is None
    assert phases.heartbeat(slow.started + QUIET_S) == "waiting for the upload: still running after 10 s"
    slow.end()
    assert said[-1].startswith("waiting for the upload: done in ")


def test_what_a_stop_does_follows_the_innermost_phase_that_says(said):
    assert phases.stop_rule() is OnStop.EXIT_NOW  # start-up: nothing trained yet
    phases.begin("training", on_stop=OnStop.AT_BOUNDARY, announce=False, base=True)
    with phases.phase("evaluation"):
        assert phases.stop_rule() is OnStop.AT_BOUNDARY and phases.current_name() == "evaluation"
        beat = phases.heartbeat(time.monotonic() + HEARTBEAT_S)  # the evaluation's (training has none)
        assert beat is not None and beat.startswith("evaluation: still running")
    phases.begin("finishing", on_stop=OnStop.FINISH, announce=False, base=True)
    assert phases.stop_rule() is OnStop.FINISH and [p.name for p in phases._STACK] == ["finishing"]


def c_call_seconds(seconds: float) -> int:
    """pbkdf2 iterations that keep a thread in C code (no Python runs there) for at least about
    `seconds` on this machine: measured, not assumed. The fastest of three tries sets the rate: a
    try slowed by the other tests' processes would make the call end early, before the lines the
    tests order against it (seen once: it returned within the 1.2 s timer)."""
    fastest = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 100_000)
        fastest = min(fastest, time.perf_counter() - start)
    return int(100_000 * seconds / max(fastest, 1e-6))


def run_stop(tmp_path: Path, phase: str, on_stop: str, *, iterations: int, env: dict | None = None):
    """A process that installs the stop watcher, opens `phase`, signals itself SIGTERM from a
    thread, and meanwhile holds its main thread in one long C call."""
    code = textwrap.dedent(f"""
        import hashlib, os, signal, sys, threading, time
        from pathlib import Path
        from bigclip.train import phases
        from bigclip.train.signals import StopRequested, catch_preemption_signals
        flag = catch_preemption_signals()
        flag.note(run_dir=Path({str(tmp_path)!r}), step=7, rank=3)
        phases.begin({phase!r}, on_stop=phases.OnStop.{on_stop}, announce=False)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        threading.Timer(1.2, print, ("a second after the signal",), {{"flush": True}}).start()
        print("C call: started", flush=True)
        try:
            hashlib.pbkdf2_hmac("sha256", b"x", b"salt", {iterations})  # holds the main thread in C
            print("C call: returned", flush=True)
            phases.current().end()
            print("carried on", flush=True)
        except StopRequested as e:
            print("StopRequested:", e, flush=True)
            sys.exit(85)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "torch" not in done.stderr, done.stderr[-2000:]
    return done, done.stdout.splitlines()


def test_a_stop_is_said_while_the_main_thread_is_still_in_c_code(tmp_path):
    """Training: the line comes at once (the watcher thread reads the wakeup pipe), the C call
    finishes, and the run carries on to its step boundary, where the Checkpointer acts."""
    done, lines = run_stop(tmp_path, "training", "AT_BOUNDARY", iterations=c_call_seconds(3))
    assert done.returncode == 0, done.stdout + done.stderr
    said = next(i for i, line in enumerate(lines) if "SIGTERM received during training" in line)
    assert lines.index("C call: started") < said < lines.index("a second after the signal")  # at once
    assert said < lines.index("C call: returned")
    assert (
        "the ranks stop at the next step boundary: they checkpoint that step and exit with 85" in lines[said]
    )
    assert lines[-1] == "carried on" and not (tmp_path / "requeue.json").exists()


def test_a_stop_before_the_first_step_ends_the_process_at_once(tmp_path):
    """Before the first step: said at once; the main thread raises StopRequested as soon as it is
    back in Python (exit 85 and the requeue marker are entry.py's)."""
    done, lines = run_stop(tmp_path, "reading checkpoint X", "EXIT_NOW", iterations=c_call_seconds(3))
    said = next(i for i, line in enumerate(lines) if "SIGTERM received during reading checkpoint X" in line)
    assert said < lines.index("a second after the signal") and "exiting now with 85 (requeue)" in lines[said]
    assert done.returncode == 85, done.stdout + done.stderr
    stopped = [line for line in lines if line.startswith("StopRequested: SIGTERM received during reading")]
    assert stopped and "C call: returned" not in lines and "carried on" not in lines, lines


def test_a_main_thread_stuck_in_c_code_past_the_grace_time_is_ended_by_the_watcher(tmp_path):
    """Told to exit at once, a rank whose main thread does not come back (a hung read, a
    collective) is ended by the watcher after BIGCLIP_STOP_GRACE_S, with 85 and the marker."""
    # A grace of 3 s, well past the 1.2 s timer line, so the watcher's line is the last one even
    # on a loaded box (with 1 s the two raced).
    done, lines = run_stop(tmp_path, "reading checkpoint X", "EXIT_NOW", iterations=c_call_seconds(60),
                           env={"BIGCLIP_STOP_GRACE_S": "3"})  # fmt: skip
    assert done.returncode == 85, done.stdout + done.stderr
    assert "C call: returned" not in lines and "did not stop within 3 s (BIGCLIP_STOP_GRACE_S)" in lines[-1]
    marker = json.loads((tmp_path / "requeue.json").read_text())
    assert marker == {
        "step": 7,
        "signal": "SIGTERM",
        "reason": "stopped during reading checkpoint X: nothing trained to checkpoint",
        "rank": 3,
        "host": socket.gethostname(),
    }


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """SIGINT counts as a stop request (the step boundary, while training); a second one is
    KeyboardInterrupt, as Ctrl-C twice is anywhere."""
    code = textwrap.dedent("""
        import os, signal, time
        from bigclip.train import phases
        from bigclip.train.signals import catch_preemption_signals
        flag = catch_preemption_signals()
        phases.begin("training", on_stop=phases.OnStop.AT_BOUNDARY, announce=False, base=True)
        os.kill(os.getpid(), signal.SIGINT)
        while not flag.said:  # the watcher's line (a run goes on meanwhile; this script waits for it)
            time.sleep(0.01)
        print("noted", signal.Signals(flag.signum).name, flush=True)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            print("stopped at once", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.stdout.splitlines()[-2:] == ["noted SIGINT", "stopped at once"], done.stdout + done.stderr
    assert "SIGINT received during training: the ranks stop at the next step boundary" in done.stdout


def test_a_peer_stop_is_read_from_the_marker_another_rank_left_during_this_run(tmp_path):
    """A rank whose set-up fails names the peer whose stop signal made it fail (entry.py), from
    the marker that peer left; not its own marker, not an earlier run's, not a checkpointed stop's."""
    flag = SignalFlag()
    flag.note(run_dir=tmp_path, rank=0)
    flag.installed_at = time.time() - 1
    assert flag.peer_stop() == ""  # no marker
    reason = "stopped during reading checkpoint s3://b/ckpt: nothing trained to checkpoint"
    write_requeue_marker(tmp_path, {"step": 3, "signal": "SIGTERM", "reason": reason, "rank": 1, "host": "n1"},
                         writer=1)  # fmt: skip
    assert flag.peer_stop() == f"rank 1 on n1 received SIGTERM and left first ({reason})"
    flag.note(rank=1)
    assert flag.peer_stop() == ""  # its own
    flag.note(rank=0)
    flag.installed_at = time.time() + 5
    assert flag.peer_stop() == ""  # an earlier run's (torchrun leaves it there)
    flag.installed_at = time.time() - 1
    write_requeue_marker(
        tmp_path, {"step": 9, "signal": "SIGUSR1", "reason": "preempted", "rank": 1}, writer=1
    )
    assert flag.peer_stop() == ""  # a stop the ranks agreed on: no set-up failed for it
