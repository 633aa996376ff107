"""The run's configuration: one dataclass per concern (a module each), composed into `TrainConfig`.

Every command-line flag is derived from a dataclass field (`batch_size` -> `--batch-size`),
so the dataclasses are the single source of truth for names, defaults, types and help.
Field names are OpenCLIP's where the concept is the same, so `open_clip_train.main`
command lines keep working. A YAML file (`--config run.yaml`) may set any field, flat
(`batch_size: 256`) or by section (`data: {batch_size: 256}`); flags override the file.

Field metadata understood by `bigclip.cli_args`:
  help     the flag's help text
  choices  allowed values
OpenCLIP's (and DeepSpeed's) other spellings of flags and values, and the OpenCLIP options bigclip
ignores or refuses, are in `bigclip.openclip_flags`, one table each.

May import errors and openclip_flags; models only lazily (ModelConfig checks --model).
"""

from bigclip.config.checkpoint import CheckpointConfig
from bigclip.config.data import DataConfig
from bigclip.config.engine import EngineConfig
from bigclip.config.fields import TOKENIZERS
from bigclip.config.log import LogConfig
from bigclip.config.loss import LossConfig
from bigclip.config.model import ModelConfig
from bigclip.config.optim import OptimConfig
from bigclip.config.precisions import PRECISION_KINDS, PRECISIONS
from bigclip.config.train import TrainConfig, section_of

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "EngineConfig",
    "LogConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "PRECISIONS",
    "PRECISION_KINDS",
    "TOKENIZERS",
    "TrainConfig",
    "section_of",
]
