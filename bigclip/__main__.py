"""`python -m bigclip`: the `bigclip` console script, for environments without its entry point."""

from __future__ import annotations

import sys

from bigclip.cli import main

if __name__ == "__main__":
    sys.exit(main())
