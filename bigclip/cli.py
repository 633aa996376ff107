"""`bigclip` console script: dispatches subcommands to their modules.

Each subcommand lives in the module that owns its responsibility and exposes
`main(argv: list[str]) -> int` (or the function named after a colon); modules are imported
lazily so `bigclip --help` is instant.
"""

from __future__ import annotations

import difflib
import os
import sys

from bigclip import __version__
from bigclip.errors import BigclipError
from bigclip.named_objects import import_named

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("bigclip.train.entry", "Train a CLIP model (the same entry as `python -m bigclip.train`)."),
    "eval": ("bigclip.train.entry:eval_main", "Evaluate weights: retrieval and zero-shot, no training."),
    "demo": ("bigclip.demo.runner", "End-to-end demo on CPU: data, S3, 2-rank training, resume, retrieval."),
    "make-demo-data": ("bigclip.demo.shapes_data", "Write synthetic captioned-image webdataset shards."),
    "index-shards": (
        "bigclip.data.index",
        "Count the samples of existing shards into sizes.json (local or S3).",
    ),
    "models": ("bigclip.models.listing", "List model configs with their parameter counts."),
    "doctor": ("bigclip.storage.doctor", "Check S3 credentials, permissions and throughput."),
    "consolidate": ("bigclip.weights.consolidate_command", "Stream a sharded checkpoint into safetensors."),
    "publish": ("bigclip.registry.commands:publish_main", "Publish an immutable named checkpoint."),
    "checkpoints": ("bigclip.registry.commands", "List, show, verify or remove published checkpoints."),
    "plan": ("bigclip.plan.command", "Per-GPU memory, FLOPs and checkpoint plan for a run."),
    "slurm": ("bigclip.launch.slurm", "Render an sbatch script for a multi-node run."),
}


def _usage() -> str:
    lines = [
        "usage: bigclip COMMAND [options]    (bigclip --version: the installed version)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<16}{text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


# A reader that closed the pipe (`bigclip models | head`) ends the command as SIGPIPE ends `yes | head`.
EXIT_BROKEN_PIPE = 128 + 13


def main(argv: list[str] | None = None) -> int:
    try:
        code = _dispatch(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, not at exit: a closed pipe is then this handler's, not a traceback
        return code
    except BrokenPipeError:
        # Python's documented way: what is still buffered goes to devnull, so exit writes nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"bigclip {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"{_usage()}\n\nbigclip: error: unknown command {name!r}; {hint}(the commands are listed above)",
              file=sys.stderr)  # fmt: skip
        return 2
    entry = import_named(COMMANDS[name][0], default="main")
    try:
        return int(entry(rest) or 0)
    except BigclipError as e:
        print(f"bigclip {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
