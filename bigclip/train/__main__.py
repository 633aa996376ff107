"""`python -m bigclip.train ...` (also under torchrun and the deepspeed launcher's `--module`):
the same entry as `bigclip train` (entry.py), which installs the signal handlers before torch."""

import sys

from bigclip.train.entry import main

sys.exit(main(sys.argv[1:], prog="bigclip"))
