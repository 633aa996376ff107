"""`python -m bigclip.train ...` (also under torchrun and the deepspeed launcher's `--module`):
the same entry as `bigclip train` (entry.py), which installs the signal handlers before torch.

The stop signals are blocked first, before anything else is imported: until entry.py installs
their handlers, a SIGTERM or SIGUSR1 (Slurm's preemption, time-limit warning or requeue) would
kill the rank (their default action) and the job would end FAILED with nothing to resume from.
Blocked, such a signal waits; installing the handlers unblocks it (signals.py) and it is handled
as any other. What remains is the interpreter's own start-up before this line (site and the
packages' .pth files), which no code of bigclip's can reach.
"""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1))

import sys  # noqa: E402

from bigclip.train.entry import main  # noqa: E402

sys.exit(main(sys.argv[1:], prog="bigclip"))
