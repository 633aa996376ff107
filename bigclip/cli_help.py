"""The help screens of `bigclip train`, rendered from the config dataclasses.

`--help`: one section per dataclass of TrainConfig, headed by its module docstring's first line,
one entry per field: its flag, its help and its default (where it has one worth saying: not an
empty text or list, not an off switch). `--help SECTION`: that section alone. `--help-openclip`:
the OpenCLIP options bigclip refuses, each with the reason its refusal prints, those it ignores
(with the reason its warning prints), and the other spellings bigclip takes. Each section fits
one screen (tests/test_cli_help.py holds the budget).
Torch-free, as the parser is: `--help` answers at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import shutil
import sys
import textwrap
import types
import typing
from typing import Any

from bigclip import openclip_flags
from bigclip.config import TrainConfig
from bigclip.errors import ConfigError

NARROWEST, WIDEST = 60, 100  # columns: the terminal's width, kept within these
HANGING = " " * 6  # an entry's continuation lines
INLINE_CHOICES = 40  # characters; a longer list of choices goes into the text, where it can wrap
_METAVARS = {int: "N", float: "X", str: "TEXT"}


def columns() -> int:
    return max(NARROWEST, min(shutil.get_terminal_size().columns, WIDEST))


def field_type(f: dataclasses.Field, owner: type) -> Any:
    """The field's type without `| None` (e.g. `int | None` -> int)."""
    hint = typing.get_type_hints(owner)[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def metavar(kind: Any) -> str:
    """How a value of `kind` is shown: N, X, TEXT; lists and KEY=VALUE words with '...'."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return f"{_METAVARS[item]}..."
    if (typing.get_origin(kind) or kind) is dict:
        return "KEY=VALUE..."
    return _METAVARS[kind]


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in TrainConfig's order."""
    return {s.name: s.default_factory for s in dataclasses.fields(TrainConfig)}


def describe(owner: type) -> str:
    """A section's one line: the first line of its module's docstring (a module per section)."""
    return (sys.modules[owner.__module__].__doc__ or "").strip().splitlines()[0]


def train_help(*, section: str = "", prog: str = "bigclip train") -> str:
    """`--help` (every section) or `--help SECTION`."""
    width = columns()
    known = sections()
    if section and section not in known:
        close = difflib.get_close_matches(section, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"--help {section}: no such section; {hint}the sections are {', '.join(known)}")
    lines = [f"usage: {prog} [--config FILE.yaml] [--OPTION VALUE ...]", ""]
    for entry in (
        f"-h, --help [SECTION]  This screen, or one section of it: {', '.join(known)}.",
        "--help-openclip  The OpenCLIP options bigclip refuses or ignores, with the reasons.",
        "--config FILE.yaml  Options from a YAML file, flat or by section; the options given override it.",
    ):
        lines += _wrap(entry, width, indent="  ")
    for name in [section] if section else known:
        lines += ["", *section_help(name, width=width)]
    return "\n".join([*lines, "", f"OpenCLIP options bigclip refuses or ignores: {prog} --help-openclip"])


def section_help(name: str, *, width: int) -> list[str]:
    owner = sections()[name]
    lines = _wrap(f"{name}: {describe(owner)}", width, indent="", hanging="")
    for f in dataclasses.fields(owner):
        lines += _wrap(_entry(f, owner), width, indent="  ")
    return lines


def _entry(f: dataclasses.Field, owner: type) -> str:
    meta = f.metadata
    flag, text = flag_of(f.name), meta["help"]
    kind, choices = field_type(f, owner), meta.get("choices", ())
    if kind is bool:
        usage = f"--[no-]{flag[2:]}"
    elif choices and len(",".join(choices)) <= INLINE_CHOICES:
        usage = f"{flag} {{{','.join(choices)}}}"
    elif choices:
        usage, text = f"{flag} CHOICE", f"{text} CHOICE: {', '.join(choices)}."
    else:
        usage = f"{flag} {metavar(kind)}"
    others = [*openclip_flags.FLAG_ALIASES.get(f.name, ((),))[0], *openclip_flags.SWITCHES.get(f.name, {})]
    also = f" Also {', '.join(others)}." if others else ""
    return f"{usage}  {text}{also}{default_note(f)}"


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def default_note(f: dataclasses.Field) -> str:
    """' (default: X)', or '' where the default says nothing (an empty text or list, an off switch)."""
    value = default_of(f)
    if value is False or value in ("", [], {}):
        return ""
    return f" (default: {'on' if value is True else value})"


def openclip_help() -> str:
    """OpenCLIP's options bigclip refuses and those it ignores (options sharing a reason together),
    the values it refuses, and the other spellings it takes."""
    width = columns()
    lines = _wrap("OpenCLIP options bigclip refuses; each fails as it is parsed, with this reason (exit code 2):",
                  width, indent="", hanging="")  # fmt: skip
    by_reason: dict[str, list[str]] = {}
    for flag, why in openclip_flags.REFUSED.items():
        by_reason.setdefault(why, []).append(flag)
    for why, flags in by_reason.items():
        lines += _wrap(" ".join(flags), width, indent="  ") + _wrap(why, width, indent=HANGING)
    lines += [
        "",
        *_wrap(
            "OpenCLIP options that do not apply to bigclip; each is taken, warned about once "
            "and ignored (leaving it out changes no result):",
            width,
            indent="",
            hanging="",
        ),
    ]
    ignored: dict[str, list[str]] = {}
    for flag, why in openclip_flags.IGNORED.items():
        ignored.setdefault(why, []).append(flag)
    for why, flags in ignored.items():
        lines += _wrap(" ".join(flags), width, indent="  ") + _wrap(why, width, indent=HANGING)
    lines += ["", "Values bigclip refuses, with the reason:"]
    for name, refused in openclip_flags.REFUSED_VALUES.items():
        for value, why in refused.items():
            lines += _wrap(f"{flag_of(name)} {value}", width, indent="  ")
            lines += _wrap(why, width, indent=HANGING)
    return "\n".join([*lines, "", "Other spellings bigclip takes:", *_spellings(width)])


def _spellings(width: int) -> list[str]:
    said = [text for owner in sections().values() for f in dataclasses.fields(owner) for text in _others(f)]
    return [line for text in said for line in _wrap(text, width, indent="  ")]


def _others(f: dataclasses.Field) -> list[str]:
    """A field's aliases (each taking the value in its own spelling), switches and value aliases."""
    flag = flag_of(f.name)
    aliases, switches = (
        openclip_flags.FLAG_ALIASES.get(f.name, ((),))[0],
        openclip_flags.SWITCHES.get(f.name, {}),
    )
    said = [f"{alias} VALUE  = {flag} (the value in its own spelling)" for alias in aliases]
    said += [f"{switch}  = {spelled(flag, value)}" for switch, value in switches.items()]
    said += [
        f"{flag} {theirs}  = {flag} {ours}"
        for theirs, ours in openclip_flags.VALUE_ALIASES.get(f.name, {}).items()
    ]
    return said


def flag_of(name: str) -> str:
    """A field's flag: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def spelled(flag: str, value: Any) -> str:
    """The command line that sets `flag`'s field to `value`: --x, --no-x or --x VALUE."""
    if isinstance(value, bool):
        return flag if value else "--no-" + flag.removeprefix("--")
    return f"{flag} {value}"


def _wrap(text: str, width: int, *, indent: str, hanging: str = HANGING) -> list[str]:
    """Wrapped at spaces only: a flag, path or URI is never split."""
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=hanging,
                         break_long_words=False, break_on_hyphens=False)  # fmt: skip
