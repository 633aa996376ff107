"""The training entry that both doors share: `python -m bigclip.train` (__main__.py, also under
torchrun and the deepspeed launcher's `--module`) and the console script's `bigclip train` (cli.py).

One function, so the two behave the same: the preemption-signal handlers go in first, before
torch is imported (seconds), so a SIGUSR1/SIGTERM during start-up is honoured after the first step
instead of killing the rank; then the loop runs, and a BigclipError (bad input) exits 2 with its
message and no traceback. Imports only the standard library and signal-safe bigclip modules at
module level (tests/test_preemption.py checks the handlers come before torch, through both doors).
"""

from __future__ import annotations

import sys

from bigclip.errors import BigclipError
from bigclip.train.signals import catch_preemption_signals


def main(argv: list[str] | None = None, *, prog: str = "bigclip train") -> int:
    """Train with `argv` (default: sys.argv[1:]); returns the exit code (85: requeue me)."""
    catch_preemption_signals()
    from bigclip.train.loop import main as train  # torch: only now, with the handlers in place

    try:
        return train(sys.argv[1:] if argv is None else argv)
    except BigclipError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
