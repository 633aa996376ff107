"""A stop signal in a rank's first moments does not kill it: `python -m bigclip.train` blocks SIGTERM
and SIGUSR1 on its first line (bigclip/train/__main__.py), before it imports the entry that installs
their handlers; installing them delivers what came meanwhile.

The signal is sent from inside that window, deterministically: a finder on sys.meta_path sends it
when the entry module is about to be imported (what the rank's imports before the handlers take:
up to seconds on a loaded node), then the rank is run as `python -m` runs it. Unblocked, the
signal's default action would end the process there (the FAILED 143 of a requeued job whose rank
was signalled while it started).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIGNAL_IN_THE_WINDOW = """
import importlib.abc, os, runpy, signal, sys

class SignalOnEntryImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "bigclip.train.entry":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.{sig})  # the rank's code runs, its handlers are not there yet
        return None

sys.meta_path.insert(0, SignalOnEntryImport())
sys.argv = ["bigclip.train", "--no-such-flag"]  # refused at once, after the handlers are in
runpy.run_module("bigclip.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_before_the_handlers_waits_for_them(sig: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SIGNAL_IN_THE_WINDOW.format(sig=sig)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    killed = done.returncode == -getattr(signal, sig)
    assert not killed, f"the rank died of {sig} before its handlers were installed"
    assert done.returncode in (2, 85), done.stdout[-2000:] + done.stderr[-2000:]  # refused, or stopped for requeue
