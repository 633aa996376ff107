"""Build the training argument parser from the config dataclasses, and parse into a TrainConfig.

Precedence: dataclass defaults < `--config FILE.yaml` < command-line flags. OpenCLIP options
bigclip refuses are declared from `bigclip.openclip_flags.REFUSED` and fail as they are parsed;
OpenCLIP's other spellings of values are converted (or refused) by `resolve_value`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, NoReturn

import yaml

from bigclip import openclip_flags
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
        known = [s for a in self._actions for s in a.option_strings]
        for word in message.split(":", 1)[1].split():
            close = difflib.get_close_matches(word.partition("=")[0], known, n=1)
            if word.startswith("-") and close:
                return f"; did you mean {close[0]}?"
        return ""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(f: dataclasses.Field, owner: type) -> type:
    hint = typing.get_type_hints(owner)[f.name]
    if isinstance(hint, types.UnionType):  # e.g. `int | None`
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


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


class _Refuse(argparse.Action):
    """An OpenCLIP option bigclip does not take: fails as soon as argparse meets it, saying why."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        raise ConfigError(openclip_flags.refusal(self.option_strings[0]))


def _choices(f: dataclasses.Field) -> list[str] | None:
    """The field's choices plus OpenCLIP's spellings, which `resolve_value` converts or refuses."""
    choices = f.metadata.get("choices")
    return None if choices is None else [*choices, *openclip_flags.accepted_spellings(f.name)]


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, owner: type) -> None:
    meta = f.metadata
    kind = _scalar_type(f, owner)
    names = [_flag(f.name)]
    origin = typing.get_origin(kind) or kind
    if origin is list:  # e.g. --image-mean 0.5 0.5 0.5
        (item,) = typing.get_args(kind)
        group.add_argument(*names, dest=f.name, type=item, nargs="+", default=None, help=meta.get("help"))
    elif origin is dict:  # e.g. --aug-cfg scale='(0.4, 1.0)'
        group.add_argument(
            *names, dest=f.name, nargs="*", action=_KeyValues, default=None, help=meta.get("help")
        )
    elif kind is bool:
        group.add_argument(
            *names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=meta.get("help")
        )
    else:
        group.add_argument(
            *names, dest=f.name, type=kind, default=None, choices=_choices(f), help=meta.get("help")
        )
    for alias in meta.get("aliases", ()):
        # Aliases take their own spelling of the value and convert it (OpenCLIP compatibility).
        group.add_argument(alias, dest=f"_alias_{f.name}", default=None, help=f"alias of {names[0]}")
    for switch, value in meta.get("switches", {}).items():
        # OpenCLIP flags without a value that mean one value of this field (e.g. --fsdp).
        group.add_argument(switch, dest=f"_switch_{f.name}", action="store_const", const=value, default=None,
                           help=f"OpenCLIP's spelling of {_spelled(names[0], value)}")  # fmt: skip


def _spelled(flag: str, value: Any) -> str:
    if isinstance(value, bool):
        return flag if value else "--no-" + flag.removeprefix("--")
    return f"{flag} {value}"


def _apply_switch(section: Any, f: dataclasses.Field, switched: Any, given: Any) -> None:
    """An OpenCLIP switch sets its value; the field's own flag may agree but not contradict it."""
    if given is not None and given != switched:
        (switch,) = [s for s, v in f.metadata["switches"].items() if v == switched][:1]
        raise ConfigError(f"{switch} means {_spelled(_flag(f.name), switched)}, which contradicts "
                          f"{_spelled(_flag(f.name), given)}: give one of them")  # fmt: skip
    setattr(section, f.name, switched)


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, owner: type,
                     names: tuple[str, ...]) -> None:  # fmt: skip
    """Some fields of a config dataclass as flags, spelled and explained as `bigclip train` does
    (for other subcommands that share them). Their default is None: not given."""
    fields = {f.name: f for f in dataclasses.fields(owner)}
    for name in names:
        _add_field(parser, fields[name], owner)


def build_parser(prog: str = "bigclip train") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description="Train a CLIP model with bigclip.")
    parser.add_argument("--config", default=None, help="YAML file of options (flat or by section).")
    for section in dataclasses.fields(TrainConfig):
        cls = section.default_factory
        group = parser.add_argument_group(section.name)
        for f in dataclasses.fields(cls):
            _add_field(group, f, cls)
    refused = parser.add_argument_group("OpenCLIP options bigclip refuses (each fails, saying why)")
    for flag, why in openclip_flags.REFUSED.items():
        refused.add_argument(flag, nargs="*", metavar="VALUE", action=_Refuse, help=why)
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


def _assign(cfg: TrainConfig, name: str, value: Any) -> None:
    if _flag(name) in openclip_flags.REFUSED:
        raise ConfigError(openclip_flags.refusal(_flag(name)))
    try:
        section = getattr(cfg, section_of(name))
    except KeyError:
        raise ConfigError(f"unknown option {name!r} (see `bigclip train --help`)") from None
    setattr(section, name, openclip_flags.resolve_value(name, value))


def parse_train_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse flags (and an optional YAML file) into a validated TrainConfig."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = TrainConfig()
    if args.config:
        for name, value in _load_yaml(args.config).items():
            _assign(cfg, name, value)
    for section in cfg.sections().values():
        for f in dataclasses.fields(section):
            alias_value = getattr(args, f"_alias_{f.name}", None)
            if alias_value is not None:
                setattr(section, f.name, f.metadata["convert"](alias_value))
            value = getattr(args, f.name)
            switched = getattr(args, f"_switch_{f.name}", None)
            if switched is not None:
                _apply_switch(section, f, switched, value)
            if value is not None:
                setattr(section, f.name, openclip_flags.resolve_value(f.name, value))
    return cfg.validate()


def to_argv(cfg: TrainConfig) -> list[str]:
    """The flags that reproduce `cfg` (non-default values only); used by script renderers."""
    default = TrainConfig()
    argv: list[str] = []
    for name, section in cfg.sections().items():
        base = getattr(default, name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if value == getattr(base, f.name):
                continue
            if isinstance(value, bool):
                argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
            elif isinstance(value, list):
                argv += [_flag(f.name), *(str(v) for v in value)]
            elif isinstance(value, dict):
                argv += [_flag(f.name), *(f"{k}={v!r}" for k, v in value.items())]
            else:
                argv += [_flag(f.name), str(value)]
    return argv
