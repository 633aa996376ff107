"""A refused run leaves no folder behind, and every rank refuses with its one line even while the
others remove the folders they all made (bigclip/train/entry.py). Seen under load: rank 0 removed
LOGS/NAME while rank 1 walked it, and rank 1 died of FileNotFoundError instead of the refusal."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bigclip.config import TrainConfig
from bigclip.errors import ConfigError
from bigclip.train import entry


def config(logs: Path, name: str) -> TrainConfig:
    cfg = TrainConfig()
    cfg.log.logs, cfg.log.name = str(logs), name
    return cfg


def test_a_refused_run_removes_the_folders_it_made_and_keeps_ones_holding_files(tmp_path):
    with pytest.raises(ConfigError), entry._nothing_left_if_refused(config(tmp_path / "logs", "run")):
        (tmp_path / "logs" / "run" / "checkpoints").mkdir(parents=True)
        raise ConfigError("refused")
    assert not (tmp_path / "logs").exists()
    (tmp_path / "kept" / "run").mkdir(parents=True)
    with pytest.raises(ConfigError), entry._nothing_left_if_refused(config(tmp_path / "kept", "run")):
        (tmp_path / "kept" / "run" / "out.log").write_text("a file someone wrote")
        raise ConfigError("refused")
    assert (tmp_path / "kept" / "run" / "out.log").exists()


def test_a_folder_another_rank_removes_mid_walk_still_gives_the_refusal(tmp_path, monkeypatch):
    walk = Path.rglob

    def other_rank_removes_it_mid_walk(self: Path, pattern: str):
        for i, found in enumerate(walk(self, pattern)):
            if i == 0:  # what the other refused rank does at that moment
                shutil.rmtree(self, ignore_errors=True)
            yield found

    monkeypatch.setattr(Path, "rglob", other_rank_removes_it_mid_walk)
    cfg = config(tmp_path / "logs", "run")
    with pytest.raises(ConfigError, match="refused"), entry._nothing_left_if_refused(cfg):
        (tmp_path / "logs" / "run" / "checkpoints" / "step_00000000").mkdir(parents=True)
        raise ConfigError("refused")
    assert not (tmp_path / "logs").exists()
