"""The training flags a rendered recipe (`bigclip slurm`) carries in its TRAIN_ARGS.

Every field of the run's configuration is written, not only those that differ from today's
defaults (`cli_args.flags_by_section(every=True)`), so a recipe trains the same after a default
changes; a field whose value is an empty list has no flag spelling (its flag takes one value or
more) and is named in a comment instead. The script runs in its working directory (#SBATCH
--chdir), and every local path is made absolute against it, so the job does not depend on where it
is submitted from. Fields that take a path or a name (--pretrained TAG, --deepspeed-config zero3)
are made absolute only when the relative path names something there.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shlex
from pathlib import Path

from bigclip.cli_args import flags_by_section
from bigclip.cli_help import flag_of
from bigclip.config import TrainConfig
from bigclip.storage.schemes import is_local, scheme_of

# Fields that hold a local path when they hold no URI ('::' separates --train-data's sources).
PATH_FIELDS = (
    "logs", "checkpoint_dir", "train_data", "val_data", "imagenet_val", "imagenet_v2", "cache_dir",
    "batch_keys_file", "registry", "remote_sync",
)  # fmt: skip
PATH_OR_NAME_FIELDS = ("pretrained", "deepspeed_config")  # a tag, registry:NAME or a shipped config's name
LAUNCHER_FIELDS = ("local_rank",)  # set for each process by DeepSpeed's launcher, never by a recipe


def absolute(value: str, chdir: Path, *, only_existing: bool = False) -> str:
    """`value` with each local relative path made absolute against `chdir`."""
    if not value:
        return value
    sources = []
    for source in value.split("::"):
        if not is_local(source) or scheme_of(source) or Path(source).expanduser().is_absolute():
            sources.append(os.path.expanduser(source))
            continue
        path = os.path.normpath(chdir / source)
        sources.append(source if only_existing and not os.path.exists(path) else path)
    return "::".join(sources)


def with_absolute_paths(cfg: TrainConfig, chdir: Path) -> TrainConfig:
    """A copy of `cfg` whose local paths are absolute (see the module docstring)."""
    out = copy.deepcopy(cfg)
    for section in out.sections().values():
        for f in dataclasses.fields(section):
            if f.name in PATH_FIELDS or f.name in PATH_OR_NAME_FIELDS:
                value = getattr(section, f.name)
                setattr(section, f.name, absolute(value, chdir, only_existing=f.name in PATH_OR_NAME_FIELDS))
    return out


def train_args_lines(cfg: TrainConfig) -> str:
    """The body of the script's TRAIN_ARGS=( ... ) array: a comment per section, one flag per line."""
    lines = []
    for section, flags in flags_by_section(cfg, every=True, skip=LAUNCHER_FIELDS).items():
        lines.append(f"    # {section}")
        lines += ["    " + " ".join(shlex.quote(word) for word in (flag, *values)) for flag, values in flags]
    unset = [flag_of(f.name) for s in cfg.sections().values() for f in dataclasses.fields(s)
             if getattr(s, f.name) == []]  # fmt: skip
    if unset:
        lines.append(f"    # not given (empty: the model's or the weights' own): {' '.join(unset)}")
    return "\n".join(lines)
