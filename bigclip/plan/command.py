"""`bigclip plan`'s entry: options parsed and checked without torch (options.py), then the planner
(report.py, which imports torch and builds the model on the meta device) only for options that hold.

    bigclip plan --gpus 1024 --gpu-memory-gib 80 --model ViT-bigG-14 --batch-size 160 \\
        --grad-checkpointing --loss-chunk-size 1024 [any other training flag]   [--dry-run] [--json]
"""

from __future__ import annotations

import sys
import time

from bigclip.plan.options import parse_plan_args


def main(argv: list[str]) -> int:
    options = parse_plan_args(argv)
    # Importing torch alone can take seconds on a cold node: say what the wait is (on stderr, so
    # the table or the JSON on stdout stays clean), and when it ended.
    start = time.monotonic()
    cfg = options.train
    print(f"bigclip plan: planning {cfg.model.model} on {options.gpus} GPUs (loading torch...)", file=sys.stderr,
          flush=True)  # fmt: skip
    from bigclip.plan.planner import print_plan  # torch: only for options that hold

    code = print_plan(options)
    print(f"bigclip plan: planned in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return code
