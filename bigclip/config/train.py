"""`TrainConfig`: the sections composed, and the flat-name lookup the CLI and YAML files use."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from bigclip.config.checkpoint import CheckpointConfig
from bigclip.config.data import DataConfig
from bigclip.config.engine import EngineConfig
from bigclip.config.log import LogConfig
from bigclip.config.loss import LossConfig
from bigclip.config.model import ModelConfig
from bigclip.config.optim import OptimConfig
from bigclip.errors import ConfigError


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def evaluates_only(self) -> bool:
        """OpenCLIP's evaluation-only run: no --train-data, an evaluation set given. The weights
        (--pretrained, --resume) are evaluated once and the run ends."""
        return not self.data.train_data.strip() and bool(self.data.evaluation_sets())

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self) -> TrainConfig:
        for section in self.sections().values():
            _check_finite(section)
            section.validate()
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> TrainConfig:
        cfg = cls()
        for name, section in cfg.sections().items():
            for key, value in values.get(name, {}).items():
                setattr(section, key, value)
        return cfg


def section_of(field_name: str) -> str:
    """Which TrainConfig section holds a (flat) field name."""
    for section in dataclasses.fields(TrainConfig):
        if field_name in {f.name for f in dataclasses.fields(section.default_factory)}:
            return section.name
    raise KeyError(field_name)


def _check_finite(section: object) -> None:
    """`float` parses 'nan' and 'inf': no option of bigclip means anything with them."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            flag = "--" + f.name.replace("_", "-")
            raise ConfigError(
                f"{flag} {value}: give a finite number (see `bigclip train --help` for its range)"
            )
