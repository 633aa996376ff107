"""`python -m bigclip.train ...` (also under torchrun and the deepspeed launcher's `--module`)."""

import sys

from bigclip.errors import BigclipError
from bigclip.train.loop import main

try:
    sys.exit(main())
except BigclipError as e:
    print(f"bigclip: error: {e}", file=sys.stderr)
    sys.exit(2)
