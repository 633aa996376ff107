"""`bigclip plan`'s entry: options parsed and checked without torch (options.py), then the planner
(report.py, which imports torch and builds the model on the meta device) only for options that hold.

    bigclip plan --gpus 1024 --gpu-memory-gib 80 --model ViT-bigG-14 --batch-size 160 \\
        --grad-checkpointing --loss-chunk-size 1024 [any other training flag]   [--dry-run] [--json]
"""

from __future__ import annotations

import sys

from bigclip.plan.options import parse_plan_args


def main(argv: list[str]) -> int:
    options = parse_plan_args(argv)
    from bigclip.plan.planner import print_plan  # torch: only for options that hold

    return print_plan(options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
