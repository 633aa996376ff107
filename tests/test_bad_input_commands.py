"""Bad options of the other commands (the command name, plan, models, doctor, consolidate, publish,
checkpoints, index-shards): one line naming the option and the fix; nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.bad_input import Case, bigclip, check

PLAN = ("--gpus", "8")
# plan, models, consolidate, publish, checkpoints and index-shards import torch before they parse
# their options (their modules load it at import): 3-5 s on an idle 2-core box, 10 s at a load of 8.
# Parsing before those imports is the owning areas' follow-up (issue 28's report); until then
# these rows get this bound instead of the suite's 5 s.
TORCH_FIRST_S = 15.0


def late(name: str, *args: str, says: tuple[str, ...], **kw) -> Case:
    """A row of a command that imports torch before parsing its options."""
    return Case(name, bigclip(*args), says, max_s=TORCH_FIRST_S, **kw)


CASES = [
    Case("unknown-command", bigclip("trian"), ("unknown command 'trian'", "did you mean train?")),
    Case("unknown-command-far", bigclip("frobnicate"), ("unknown command 'frobnicate'", "listed above")),
    late("plan-gpus-missing", "plan", "--model", "tiny", says=("required: --gpus",)),
    late("plan-gpus-zero", "plan", "--gpus", "0", says=("--gpus", "must be at least 1")),
    late("plan-model-unknown", "plan", *PLAN, "--model", "ViT-Q-99", says=("unknown model 'ViT-Q-99'",)),
    late("plan-lr-nan", "plan", *PLAN, "--lr", "nan", says=("--lr nan", "finite number")),
    late("plan-batch-zero", "plan", *PLAN, "--batch-size", "0", says=("--batch-size", "at least 1")),
    late("plan-unknown-flag", "plan", *PLAN, "--bogus", says=("unrecognized arguments: --bogus",)),
    late("models-with-options", "models", "--bogus", says=("bigclip models takes no options",)),
    Case("doctor-location-missing", bigclip("doctor"), ("required: location", "bigclip doctor --help")),
    Case("doctor-size-negative", bigclip("doctor", "ckpt", "--size-mb", "-1"), ("--size-mb", "got -1")),
    Case("doctor-timeout-zero", bigclip("doctor", "ckpt", "--timeout-s", "0"), ("--timeout-s positive",)),
    late("doctor-file-in-the-way", "doctor", "notes.txt", "--size-mb", "0",  # its checks load torch
         says=("notes.txt: folder", "a file, not a folder", "give a folder"), code=1),
    late("consolidate-args-missing", "consolidate", says=("required: src",)),
    late("consolidate-source-missing", "consolidate", "nope", "out.safetensors",
         says=("nope is neither a weights file", "manifest.json")),
    late("publish-args-missing", "publish", says=("required: src, name",)),
    late("checkpoints-command-missing", "checkpoints", says=("required: command",)),
    late("checkpoints-command-unknown", "checkpoints", "frob", says=("invalid choice: 'frob'", "'list'")),
    late("checkpoints-no-registry", "checkpoints", "list", says=("no registry given", "BIGCLIP_REGISTRY"),
         env={"BIGCLIP_REGISTRY": ""}),
    late("index-shards-pattern-missing", "index-shards", says=("required: pattern",)),
    late("index-shards-no-shard", "index-shards", "nope/{00000..00003}.tar",
         says=("matches no shard", "Check the path, the brace range")),
]  # fmt: skip
NEEDS_DATA_FIX = [  # bigclip/data/index.py (the data area's): braceexpand's exception escapes
    late("index-shards-unbalanced-brace", "index-shards", "nope/{00000..00003.tar", says=("unbalanced",)),
]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("commands")
    (home / "notes.txt").write_text("not a folder\n")
    return home


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_command_option(case: Case, home: Path) -> None:
    check(case, cwd=home, protect=[home])
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]


@pytest.mark.xfail(strict=True, reason="bigclip/data: expand_pattern lets UnbalancedBracesError escape")
@pytest.mark.parametrize("case", NEEDS_DATA_FIX, ids=[c.name for c in NEEDS_DATA_FIX])
def test_bad_command_option_the_data_code_must_fix(case: Case, home: Path) -> None:
    check(case, cwd=home, protect=[home])
