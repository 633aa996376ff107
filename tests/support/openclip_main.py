"""OpenCLIP main's trainer options, kept as test data (main is not on the package registry).

`tests/data/openclip_main_params.json` lists every option of `src/open_clip_train/params.py` at
the commit it names: option strings, dest, nargs, type, choices, default. Regenerate it from a
checkout of https://github.com/mlfoundations/open_clip (the file needs only the standard library):

    git -C open_clip show COMMIT:src/open_clip_train/params.py > /tmp/params.py
    python tests/support/openclip_main.py /tmp/params.py COMMIT > tests/data/openclip_main_params.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "openclip_main_params.json"
TYPES = {"int": int, "float": float, "str": str, None: None}


@dataclass
class MainOption:
    """The parts of an argparse Action that the parity test reads."""

    option_strings: list[str]
    dest: str
    nargs: Any
    type: Any
    choices: list[str] | None
    default: Any


def main_options() -> tuple[str, list[MainOption]]:
    """(commit, options) from the test data."""
    data = json.loads(DATA.read_text())
    options = [MainOption(**{**o, "type": TYPES[o["type"]]}) for o in data["options"]]
    return data["commit"], options


def _capture(params_py: str) -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("openclip_main_params", params_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    captured = []

    def capture(parser, args=None, namespace=None):  # noqa: ANN001
        captured.append(parser)
        raise SystemExit

    argparse.ArgumentParser.parse_args = capture  # a throwaway process: nothing to restore
    with contextlib.suppress(SystemExit):
        module.parse_args([])
    return captured[0]


def describe(params_py: str, commit: str) -> dict:
    actions = [a for a in _capture(params_py)._actions if a.option_strings and a.dest != "help"]
    kinds = {int: "int", float: "float", str: "str", None: None}
    return {
        "repository": "https://github.com/mlfoundations/open_clip",
        "commit": commit,
        "path": "src/open_clip_train/params.py",
        "options": [
            {
                "option_strings": a.option_strings,
                "dest": a.dest,
                "nargs": a.nargs,
                "type": kinds.get(a.type),
                "choices": list(a.choices) if a.choices else None,
                "default": a.default,
            }
            for a in actions
        ],
    }


if __name__ == "__main__":
    json.dump(describe(sys.argv[1], sys.argv[2]), sys.stdout, indent=1)
    sys.stdout.write("\n")
