"""Run bad-input rows' command lines in one interpreter through `bigclip.cli.main` and report
whether torch got imported: the proof that a flag-settled refusal never pays for torch (seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.bad_input import ROOT, Case

PROBE = """
import contextlib, io, json, os, sys
from bigclip.cli import main
codes = {}
for name, argv, env in json.loads(sys.argv[1]):
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if v is not None})
    for k in [k for k, v in env.items() if v is None]:
        os.environ.pop(k, None)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            codes[name] = main(argv)
        except SystemExit as e:  # argparse's own refusals
            codes[name] = e.code
    os.environ.clear()
    os.environ.update(saved)
    if "torch" in sys.modules:
        break  # the row that loaded it is the last one in `codes`
print(json.dumps({"torch": "torch" in sys.modules, "codes": codes}))
"""


def refusals_without_torch(cases: list[Case], *, cwd: Path) -> dict:
    """{"torch": loaded?, "codes": {row: exit code}} for `cases` (`python -m bigclip ...` rows)."""
    rows = [[c.name, list(c.argv[2:]), c.env] for c in cases]
    assert all(c.argv[:2] == ("-m", "bigclip") for c in cases)
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(rows)], capture_output=True, text=True,
                          cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)
