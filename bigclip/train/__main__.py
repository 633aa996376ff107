"""`python -m bigclip.train ...` (also under torchrun and the deepspeed launcher's `--module`)."""

import sys

from bigclip.train.signals import catch_preemption_signals

# First, before torch is imported (seconds): SIGUSR1/SIGTERM during start-up must not kill the rank.
catch_preemption_signals()

from bigclip.errors import BigclipError  # noqa: E402
from bigclip.train.loop import main  # noqa: E402

try:
    sys.exit(main())
except BigclipError as e:
    print(f"bigclip: error: {e}", file=sys.stderr)
    sys.exit(2)
