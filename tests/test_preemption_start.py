"""A stop signal at either end of a rank's life, where the run's own handlers are not in place,
does not kill it (bigclip/train/__main__.py):
- in its first moments, before the entry that installs the handlers is imported: the signal
  waits (blocked) and the handlers get it once installed;
- after the run, once the handlers have given back what they replaced: the finished run's exit
  code stands (a late kill used to end a completed job FAILED 143, its final checkpoint committed).

Each signal is sent from inside its window, deterministically, by a hook in the real process
(`python -m bigclip.train` run as runpy runs it): a finder on sys.meta_path that signals when the
entry module is about to be imported, and a wrapper that signals right after the handlers are
uninstalled. Without the protection the default action of SIGTERM or SIGUSR1 ends the process there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.launch_harness import LAUNCHER_VARIABLES
from support.train_harness import demo_argv

ROOT = Path(__file__).resolve().parents[1]
RUN_AS_MAIN = 'runpy.run_module("bigclip.train", run_name="__main__", alter_sys=True)'
AT_START = """
import importlib.abc, os, runpy, signal, sys

class SignalOnEntryImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "bigclip.train.entry":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.{sig})  # the rank's code runs, its handlers are not there yet
        return None

sys.meta_path.insert(0, SignalOnEntryImport())
sys.argv = ["bigclip.train", "--no-such-flag"]  # refused at once, after the handlers are in
"""
AT_END = """
import json, os, runpy, signal, sys
from bigclip.train import signals

uninstall = signals.SignalFlag.uninstall

def uninstall_then_a_late_kill(self):
    uninstall(self)
    os.kill(os.getpid(), signal.{sig})  # the run is over and its handlers are gone

signals.SignalFlag.uninstall = uninstall_then_a_late_kill
sys.argv = ["bigclip.train", *json.loads(os.environ["ARGV"])]
"""


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")
    }
    return subprocess.run([sys.executable, "-c", code + RUN_AS_MAIN], env={**clean, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_before_the_handlers_waits_for_them(sig: str) -> None:
    done = run(AT_START.format(sig=sig))
    assert done.returncode != -getattr(signal, sig), (
        f"the rank died of {sig} before its handlers were installed"
    )
    assert done.returncode in (2, 85), (
        done.stdout[-2000:] + done.stderr[-2000:]
    )  # refused, or stopped for requeue


def test_a_late_signal_after_the_run_leaves_its_exit_code(demo_data, tmp_path) -> None:
    argv = demo_argv(demo_data, tmp_path, "--max-steps", "2", "--save-frequency", "0", "--val-frequency", "0")
    done = run(AT_END.format(sig="SIGTERM"), ARGV=json.dumps(argv))
    out = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode != -signal.SIGTERM, f"the finished run died of the late SIGTERM:\n{out}"
    assert done.returncode == 0 and "done: {'step': 2" in done.stdout, out
