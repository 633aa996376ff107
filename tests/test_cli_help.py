"""`bigclip train --help` by section, each fitting one screen; `--help-openclip` with the reasons.

The screen: a terminal SCREEN_COLUMNS wide shows one section of `--help` (or `--help SECTION`)
whole in SECTION_LINES rows. Every config field appears under its own section with its default;
no refused OpenCLIP option appears there, and each is listed by `--help-openclip` with the reason
its refusal prints. The help is read from the real command, and costs no torch import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from bigclip import cli_help
from bigclip.cli_args import build_parser, parse_train_args
from bigclip.errors import ConfigError
from bigclip.openclip_flags import IGNORED, REFUSED, REFUSED_VALUES, refusal, resolve_value

SCREEN_COLUMNS, SECTION_LINES = 100, 40
SECTIONS = cli_help.sections()


def bigclip(*args: str, columns: int = SCREEN_COLUMNS) -> str:
    env = {**os.environ, "COLUMNS": str(columns)}
    done = subprocess.run([sys.executable, "-m", "bigclip", *args], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0 and not done.stderr, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def help_text() -> str:
    return bigclip("train", "--help")


def by_section(text: str) -> dict[str, str]:
    """The help's section blocks, by name: from each 'NAME: description' line to the blank line."""
    blocks = {}
    for block in text.split("\n\n"):
        name = block.partition(":")[0]
        if name in SECTIONS:
            blocks[name] = block
    return blocks


def flat(text: str) -> str:
    return " ".join(text.split())


def mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_the_parser_has_one_group_per_section_holding_its_fields():
    groups = {g.title: g for g in build_parser()._action_groups}
    for name, owner in SECTIONS.items():
        assert groups[name].description == cli_help.describe(owner) and "\n" not in groups[name].description
        dests = {a.dest for a in groups[name]._group_actions}
        assert {f.name for f in dataclasses.fields(owner)} <= dests


def test_every_field_is_under_its_section_with_its_default(help_text):
    blocks = by_section(help_text)
    assert list(blocks) == list(SECTIONS)
    for name, owner in SECTIONS.items():
        assert flat(blocks[name]).startswith(f"{name}: {cli_help.describe(owner)}")
        for f in dataclasses.fields(owner):
            flag = f.name.replace("_", "-")
            entry = re.search(rf"^  --(\[no-\])?{flag} .*?(?=^  --|\Z)", blocks[name], flags=re.M | re.S)
            assert entry, f"--{flag} is not in section {name}"
            assert flat(f.metadata["help"]) in flat(entry[0])
            default = cli_help.default_of(f)
            if default not in ("", [], {}, False):
                shown = "on" if default is True else default
                assert flat(entry[0]).endswith(f"(default: {shown})"), entry[0]


def test_defaults_without_meaning_are_not_shown():
    notes = {f.name: cli_help.default_note(f) for o in SECTIONS.values() for f in dataclasses.fields(o)}
    assert notes["train_data"] == notes["grad_checkpointing"] == notes["image_mean"] == notes["aug_cfg"] == ""
    assert notes["batch_size"] == " (default: 64)" and notes["reshard_after_forward"] == " (default: on)"
    assert notes["train_num_samples"] == " (default: 0)"  # 0 means something: read sizes.json


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_section_fits_a_screen(name, help_text):
    alone = bigclip("train", "--help", name)
    block = by_section(alone)[name]
    assert block == by_section(help_text)[name]  # --help SECTION: the same section, alone
    assert list(by_section(alone)) == [name]
    lines = block.splitlines()
    assert len(lines) <= SECTION_LINES, f"{name}: {len(lines)} lines"
    assert max(len(line) for line in lines) <= SCREEN_COLUMNS


def test_help_wraps_to_a_narrower_terminal():
    text = bigclip("train", "--help", "data", columns=80)
    assert max(len(line) for line in text.splitlines()) <= 80


def test_no_refused_option_is_in_help_and_each_is_in_help_openclip_with_its_reason(help_text):
    listed = flat(bigclip("train", "--help-openclip"))
    for flag, why in REFUSED.items():
        assert not mentions(help_text, flag), flag
        assert mentions(listed, flag) and flat(why) in listed, flag
        with pytest.raises(ConfigError) as refused:  # still refused, with that reason
            parse_train_args([flag])
        assert str(refused.value) == refusal(flag) and str(refused.value).endswith(why)
    for flag, why in IGNORED.items():
        assert not mentions(help_text, flag), flag
        assert mentions(listed, flag) and flat(why) in listed, flag
    for name, values in REFUSED_VALUES.items():
        for value, why in values.items():
            assert f"--{name.replace('_', '-')} {value} {flat(why)}" in listed
            with pytest.raises(ConfigError, match=re.escape(why)):
                resolve_value(name, value)
    assert "--help-openclip" in help_text.splitlines()[-1]


def test_help_openclip_lists_the_other_spellings_bigclip_takes():
    listed = flat(bigclip("train", "--help-openclip"))
    for spelling in ("--use-bnb-linear VALUE = --linear-kind", "--opt VALUE = --optimizer", "--fsdp = --engine fsdp",
                     "--precision amp_bfloat16 = --precision amp_bf16"):  # fmt: skip
        assert spelling in listed
    assert build_parser().parse_args(["--fsdp"]).__dict__["_switch_engine"] == "fsdp"


def test_help_answers_without_torch():
    probe = (
        "import contextlib, io, json, sys\nfrom bigclip.cli import main\n"
        "for argv in (['train', '--help'], ['train', '--help', 'data'], ['train', '--help-openclip'], ['plan', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "print(json.dumps('torch' in sys.modules))"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout) is False, done.stderr


def test_plan_help_shows_its_defaults_and_where_the_training_options_are():
    text = flat(bigclip("plan", "--help"))
    assert "(default: 80.0)" in text and "(default: 0.4)" in text
    assert "bigclip train --help [SECTION]" in text
