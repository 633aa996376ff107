"""Build the training argument parser from the config dataclasses, and parse into a TrainConfig.

Precedence: dataclass defaults < `--config FILE.yaml` < command-line flags. OpenCLIP options
bigclip refuses are declared from `bigclip.openclip_flags.REFUSED` and fail as they are parsed;
those that do not apply (`IGNORED`) are taken with their values and warned about once
(`--help` leaves both out; `--help-openclip` lists them); OpenCLIP's other spellings of values are
converted (or refused) by `resolve_value`. The help screens are `bigclip.cli_help`'s.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any, NoReturn

import yaml

from bigclip import cli_help, openclip_flags
from bigclip.cli_help import field_type, flag_of, metavar, spelled
from bigclip.config import TrainConfig, section_of
from bigclip.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a ConfigError: one line (no usage screen above it) that names the
    flag, the nearest known spelling, and where the options are listed; the CLI exits 2 with it.
    Negative numbers in any float spelling (-1e-3, -.5) are values, not unknown options (argparse
    takes only -1 and -0.5 for numbers, so `--lr -1e-3` said "expected one argument")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}{self._nearest(message)} (see `{self.prog} --help`)")

    def _nearest(self, message: str) -> str:
        if not message.startswith("unrecognized arguments:"):
            return ""
        words = message.split(":", 1)[1].split()
        loose = [w for w in words if not w.startswith("-")]
        if len(loose) > 1 or any(any(c in w for c in "/.*") for w in loose):
            # `--train-data /d/{0..3}.tar` unquoted: the shell passes /d/0.tar /d/1.tar ... as words.
            return (f"; {len(loose)} word(s) no option takes: did the shell expand an unquoted pattern? Quote it "
                    "so that bigclip expands it, e.g. '/data/{00000..00099}.tar'")  # fmt: skip
        known = [s for a in self._actions for s in a.option_strings]
        for word in words:
            close = difflib.get_close_matches(word.partition("=")[0], known, n=1)
            if word.startswith("-") and close:
                return f"; did you mean {close[0]}?"
        return ""


class _KeyValues(argparse.Action):
    """OpenCLIP's `ParseKwargs`: KEY=VALUE words -> dict, values read with ast.literal_eval."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        result: dict[str, Any] = {}
        for word in values:
            key, sep, value = word.partition("=")
            if not sep or not key:
                parser.error(f"{option_string} takes KEY=VALUE words, got {word!r}")
            try:
                result[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                result[key] = value  # a plain string needs no quotes, as in OpenCLIP
        setattr(namespace, self.dest, result)


class _Help(argparse.Action):
    """`--help [SECTION]`: every section, or one; then exit 0."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        print(cli_help.train_help(section=values or "", prog=parser.prog))
        parser.exit()


class _HelpOpenclip(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        print(cli_help.openclip_help())
        parser.exit()


class _Refuse(argparse.Action):
    """An OpenCLIP option bigclip does not take: fails as soon as argparse meets it, saying why."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        raise ConfigError(openclip_flags.refusal(self.option_strings[0]))


class _Ignore(argparse.Action):
    """An OpenCLIP option that does not apply: its values are taken, one warning says why."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        openclip_flags.warn_ignored(self.option_strings[0])


def _choices(f: dataclasses.Field) -> list[str] | None:
    """The field's choices plus OpenCLIP's spellings, which `resolve_value` converts or refuses."""
    choices = f.metadata.get("choices")
    return None if choices is None else [*choices, *openclip_flags.accepted_spellings(f.name)]


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, owner: type) -> None:
    meta = f.metadata
    kind = field_type(f, owner)
    names = [flag_of(f.name)]
    origin = typing.get_origin(kind) or kind
    if origin is list:  # e.g. --image-mean 0.5 0.5 0.5
        (item,) = typing.get_args(kind)
        group.add_argument(*names, dest=f.name, type=item, nargs="+", default=None, metavar=metavar(item),
                           help=meta.get("help"))  # fmt: skip
    elif origin is dict:  # e.g. --aug-cfg scale='(0.4, 1.0)'
        group.add_argument(*names, dest=f.name, nargs="*", action=_KeyValues, default=None, metavar="KEY=VALUE",
                           help=meta.get("help"))  # fmt: skip
    elif kind is bool:
        group.add_argument(
            *names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=meta.get("help")
        )
    else:
        choices = _choices(f)
        group.add_argument(*names, dest=f.name, type=kind, default=None, choices=choices,
                           metavar=None if choices else metavar(kind), help=meta.get("help"))  # fmt: skip
    for alias in openclip_flags.FLAG_ALIASES.get(f.name, ((), str))[0]:
        # Aliases take their own spelling of the value and convert it (OpenCLIP compatibility).
        group.add_argument(
            alias, dest=f"_alias_{f.name}", default=None, metavar="VALUE", help=f"alias of {names[0]}"
        )
    for switch, value in openclip_flags.SWITCHES.get(f.name, {}).items():
        # OpenCLIP flags without a value that mean one value of this field (e.g. --fsdp).
        group.add_argument(switch, dest=f"_switch_{f.name}", action="store_const", const=value, default=None,
                           help=f"OpenCLIP's spelling of {spelled(names[0], value)}")  # fmt: skip


def _apply_switch(section: Any, f: dataclasses.Field, switched: Any, given: Any) -> None:
    """An OpenCLIP switch sets its value; the field's own flag may agree but not contradict it."""
    if given is not None and given != switched:
        (switch,) = [s for s, v in openclip_flags.SWITCHES[f.name].items() if v == switched][:1]
        raise ConfigError(f"{switch} means {spelled(flag_of(f.name), switched)}, which contradicts "
                          f"{spelled(flag_of(f.name), given)}: give one of them")  # fmt: skip
    setattr(section, f.name, switched)


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, owner: type,
                     names: tuple[str, ...]) -> None:  # fmt: skip
    """Some fields of a config dataclass as flags, spelled and explained as `bigclip train` does
    (for other subcommands that share them). Their default is None: not given."""
    fields = {f.name: f for f in dataclasses.fields(owner)}
    for name in names:
        _add_field(parser, fields[name], owner)


class TrainArgumentParser(ArgumentParser):
    """The training parser: its help is `bigclip.cli_help`'s screen, by section."""

    def format_help(self) -> str:
        return cli_help.train_help(prog=self.prog) + "\n"


def build_parser(prog: str = "bigclip train") -> argparse.ArgumentParser:
    parser = TrainArgumentParser(
        prog=prog, add_help=False, usage=f"{prog} [--config FILE.yaml] [--OPTION VALUE ...]"
    )
    parser.add_argument("-h", "--help", nargs="?", const="", metavar="SECTION", action=_Help,
                        help="This screen, or one section of it.")  # fmt: skip
    parser.add_argument("--help-openclip", nargs=0, action=_HelpOpenclip,
                        help="The OpenCLIP options bigclip refuses or ignores, with the reasons.")  # fmt: skip
    parser.add_argument(
        "--config", default=None, metavar="FILE.yaml", help="YAML file of options (flat or by section)."
    )
    for name, owner in cli_help.sections().items():
        group = parser.add_argument_group(name, cli_help.describe(owner))
        for f in dataclasses.fields(owner):
            _add_field(group, f, owner)
    for flag in openclip_flags.REFUSED:  # not in --help: --help-openclip lists them
        parser.add_argument(flag, nargs="*", metavar="VALUE", action=_Refuse, help=argparse.SUPPRESS)
    for flag in openclip_flags.IGNORED:  # no bigclip option takes a positional value: "*" is safe
        parser.add_argument(flag, nargs="*", metavar="VALUE", action=_Ignore, help=argparse.SUPPRESS)
    return parser


def _load_yaml(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"--config {path}: file not found") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values")
    flat: dict[str, Any] = {}
    sections = {f.name for f in dataclasses.fields(TrainConfig)}
    for key, value in data.items():
        if key in sections and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key.replace("-", "_")] = value
    return flat


def _assign(cfg: TrainConfig, name: str, value: Any, *, path: str) -> None:
    if flag_of(name) in openclip_flags.REFUSED:
        raise ConfigError(openclip_flags.refusal(flag_of(name)))
    if flag_of(name) in openclip_flags.IGNORED:
        openclip_flags.warn_ignored(flag_of(name))
        return
    try:
        section = getattr(cfg, section_of(name))
    except KeyError:
        raise ConfigError(f"unknown option {name!r} (see `bigclip train --help`)") from None
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    value = _yaml_value(f, type(section), value, where=f"--config {path}: {name}")
    setattr(section, name, openclip_flags.resolve_value(name, value))


_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text", dict: "a mapping"}
_ITEMS = {int: "whole numbers", float: "numbers", str: "texts"}


def _yaml_value(f: dataclasses.Field, owner: type, value: Any, *, where: str) -> Any:
    """A YAML value checked as its flag's text is: of the field's type (a string converted as argparse
    converts the flag's text, so `lr: 1e-3`, a string to YAML, is a number), among its choices."""
    kind = field_type(f, owner)
    if value is None and type(None) in typing.get_args(typing.get_type_hints(owner)[f.name]):
        return None
    try:
        value = _converted(kind, value)
    except (TypeError, ValueError):
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        what = f"a list of {_ITEMS[item]}" if item else _KINDS[typing.get_origin(kind) or kind]
        scalar = item is None and f.default is not dataclasses.MISSING  # lists and mappings have factories
        example = f"; write e.g. {f.name}: {yaml.safe_dump(f.default).splitlines()[0]}" if scalar else ""
        raise ConfigError(
            f"{where}: {value!r} is not {what} (the value {flag_of(f.name)} takes){example}"
        ) from None
    choices = _choices(f)
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: invalid choice {value!r} (choose from {', '.join(map(str, choices))})")
    return value


def _converted(kind: Any, value: Any) -> Any:
    """`value` as `kind`, as the flag's parser reads it; TypeError or ValueError when it is not one."""
    origin = typing.get_origin(kind) or kind
    if origin is list:  # one value is a list of one, as `--image-mean 0.5` is
        return [
            _converted(typing.get_args(kind)[0], v) for v in (value if isinstance(value, list) else [value])
        ]
    if origin is dict or kind is bool:
        if not isinstance(value, origin):
            raise TypeError(value)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(value)  # `epochs: true`, a list or a mapping where one value goes
    if kind is int and isinstance(value, float):
        raise ValueError(value)  # `epochs: 1.5`, which `--epochs 1.5` refuses too
    return kind(value)  # str -> int/float as argparse's type=; a number -> str (`name: 2024`)


def parse_train_args(argv: list[str] | None = None, *, prog: str = "bigclip train") -> TrainConfig:
    """Parse flags (and an optional YAML file) into a validated TrainConfig."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    cfg = TrainConfig()
    if args.config:
        for name, value in _load_yaml(args.config).items():
            _assign(cfg, name, value, path=args.config)
    for section in cfg.sections().values():
        for f in dataclasses.fields(section):
            alias_value = getattr(args, f"_alias_{f.name}", None)
            if alias_value is not None:
                setattr(section, f.name, openclip_flags.FLAG_ALIASES[f.name][1](alias_value))
            value = getattr(args, f.name)
            switched = getattr(args, f"_switch_{f.name}", None)
            if switched is not None:
                _apply_switch(section, f, switched, value)
            if value is not None:
                setattr(section, f.name, openclip_flags.resolve_value(f.name, value))
    return cfg.validate()


def to_argv(cfg: TrainConfig) -> list[str]:
    """The flags that reproduce `cfg` (non-default values only)."""
    return [
        word for flags in flags_by_section(cfg).values() for flag, values in flags for word in (flag, *values)
    ]


def flags_by_section(
    cfg: TrainConfig, *, every: bool = False, skip: tuple[str, ...] = ()
) -> dict[str, list[tuple[str, list[str]]]]:
    """The flags that reproduce `cfg`, as (flag, its values) per section: the values other than the
    defaults, or with `every` every field's (so the result does not depend on today's defaults), but
    those named in `skip` and empty lists, which no flag spells (their flags take one value or more).
    A renderer may write them one per line; `to_argv` joins them."""
    default = TrainConfig()
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for name, section in cfg.sections().items():
        base, flags = getattr(default, name), out.setdefault(name, [])
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if f.name in skip or (not every and value == getattr(base, f.name)) or value == []:
                continue
            if isinstance(value, bool):
                flags.append((flag_of(f.name) if value else "--no-" + f.name.replace("_", "-"), []))
            elif isinstance(value, list):
                flags.append((flag_of(f.name), [str(v) for v in value]))
            elif isinstance(value, dict):
                flags.append((flag_of(f.name), [f"{k}={v!r}" for k, v in value.items()]))
            else:
                flags.append((flag_of(f.name), [str(value)]))
    return out
