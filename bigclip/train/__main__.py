"""`python -m bigclip.train ...` (also under torchrun and the deepspeed launcher's `--module`):
the same entry as `bigclip train` (entry.py), which installs the signal handlers before torch.

A rank's stop signals (SIGTERM, SIGUSR1: Slurm's preemption, time-limit warning and requeue, a
late kill, a launcher's) must not kill it at either end of its life, where the run's handlers
are not in place and their default action (termination) would apply:
- before entry.py installs the handlers, they are blocked, from this module's first line: a
  signal then waits, and installing the handlers unblocks it (signals.py), so it is handled as
  any other. Killed instead, the rank would end the job FAILED with nothing to resume from;
- once the run is over, the handlers give back what they replaced (signals.py, `uninstall`):
  here that is SIG_IGN, set below, not the default action. A late signal (a kill Slurm retries
  at a node that answered late, srun ending the other ranks once one exits 85) would otherwise
  turn a finished run's 0 or 85 into a death by signal: 128 + 15, no requeue marker, the job
  FAILED although its final checkpoint is committed. (Linux keeps a blocked signal pending even
  while its action is SIG_IGN, so one that comes during start-up still reaches the handlers.)
What is left is the interpreter's own start-up before this module runs (site and the .pth files
of the environment), which no code of bigclip's can reach.
"""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
for _sig in STOP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)

import sys  # noqa: E402

from bigclip.train.entry import main  # noqa: E402

sys.exit(main(sys.argv[1:], prog="bigclip"))
