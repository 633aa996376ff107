"""Flags derived from the config dataclasses, YAML files, OpenCLIP compatibility, fast failures."""

import subprocess
import sys

import pytest

from bigclip.cli_args import build_parser, parse_train_args, to_argv
from bigclip.config import TrainConfig
from bigclip.errors import ConfigError
from bigclip.train.schedule import lr_at

OPENCLIP_FLAGS = [
    "--model", "ViT-B-32", "--train-data", "/data/{00000..00009}.tar", "--batch-size", "256",
    "--epochs", "10", "--lr", "1e-3", "--wd", "0.1", "--warmup", "2000", "--precision", "amp_bf16",
    "--grad-checkpointing", "--force-patch-dropout", "0.5", "--local-loss", "--gather-with-grad",
    "--workers", "8", "--dataset-resampled", "--train-num-samples", "1000000", "--logs", "/tmp/logs",
    "--name", "run1", "--accum-freq", "2", "--save-frequency", "1", "--resume", "latest",
    "--delete-previous-checkpoint", "--remote-sync", "s3://b/runs", "--remote-sync-frequency", "60",
    "--remote-sync-protocol", "s3", "--torchcompile", "--seed", "7", "--log-every-n-steps", "50",
    "--grad-clip-norm", "1.0", "--beta1", "0.9", "--beta2", "0.95", "--eps", "1e-8",
]  # fmt: skip


def test_openclip_command_lines_parse():
    cfg = parse_train_args(OPENCLIP_FLAGS)
    assert cfg.model.model == "ViT-B-32" and cfg.data.batch_size == 256
    assert cfg.model.grad_checkpointing and cfg.model.force_patch_dropout == 0.5
    assert cfg.loss.local_loss and cfg.loss.gather_with_grad
    assert cfg.optim.accum_freq == 2 and cfg.optim.beta2 == 0.95
    assert cfg.checkpoint.resume == "latest" and cfg.log.remote_sync == "s3://b/runs"


def test_every_field_has_a_flag():
    flags = {a.dest for a in build_parser()._actions}
    for section in TrainConfig().sections().values():
        for name in vars(section):
            assert name in flags, name


def test_use_bnb_linear_alias_maps_to_int8():
    assert (
        parse_train_args(["--use-bnb-linear", "SwitchBackLinearGlobal"]).model.linear_kind
        == "switchback-global"
    )
    assert parse_train_args(["--int8", "switchback-vectorwise"]).model.linear_kind == "switchback-vectorwise"
    with pytest.raises(ConfigError, match="SwitchBackLinearGlobal"):
        parse_train_args(["--use-bnb-linear", "Linear8bitLt"])


def test_siglip_switch_selects_siglip_loss():
    assert parse_train_args(["--siglip"]).loss.loss == "siglip"


def test_yaml_sets_values_and_flags_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("batch_size: 16\nlr: 0.002\noptim:\n  warmup: 5\nmodel: ViT-L-14\n")
    cfg = parse_train_args(["--config", str(path), "--lr", "0.003"])
    assert (cfg.data.batch_size, cfg.optim.lr, cfg.optim.warmup, cfg.model.model) == (
        16,
        0.003,
        5,
        "ViT-L-14",
    )


def test_yaml_unknown_key_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("batch_sise: 16\n")
    with pytest.raises(ConfigError, match="batch_sise"):
        parse_train_args(["--config", str(path)])


def test_to_argv_round_trips():
    cfg = parse_train_args(OPENCLIP_FLAGS)
    assert parse_train_args(to_argv(cfg)).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--accum-freq", "0"], "--accum-freq"),
        (["--force-patch-dropout", "1.0"], "--force-patch-dropout"),
        (["--engine", "deepspeed"], "--deepspeed-config"),
        (["--int8-attention"], "--int8"),
        (["--loss-chunk-size", "-1"], "--loss-chunk-size"),
    ],
)
def test_inconsistent_options_are_explained(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_train_args(argv)


def test_cli_fails_fast_with_a_message(tmp_path):
    """A bad option fails with exit code 2 while the flags are parsed: no process group, no run
    folder, no model (the time it takes is not asserted: this box is shared)."""
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "bigclip.cli", "train", "--batch-size", "0", "--logs", str(logs)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--batch-size must be at least 1" in proc.stderr
    assert not logs.exists()


def test_unknown_model_fails_fast_listing_models(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bigclip.cli", "train", "--model", "ViT-Q-99", "--logs", str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "ViT-bigG-14" in proc.stderr and "ViT-Q-99" in proc.stderr


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig().optim
    cfg.lr, cfg.warmup = 1.0, 10
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.5)
    assert lr_at(110, cfg, 110) == pytest.approx(0.0)
    cfg.lr_scheduler = "const"
    assert lr_at(100, cfg, 110) == 1.0


@pytest.mark.parametrize(
    "scheduler, extra",
    [("cosine", []), ("const", []), ("const-cooldown", ["--epochs-cooldown", "3", "--lr-cooldown-power", "2",
                                                         "--lr-cooldown-end", "1e-5"])],
)  # fmt: skip
def test_lr_schedules_equal_openclips_scheduler(scheduler, extra):
    """Every step of every schedule against OpenCLIP's own `open_clip_train.scheduler`."""
    from support.openclip_ref import open_clip_train_parser

    open_clip_train_parser()  # skips (fails on CI) when OpenCLIP's trainer is not installed
    import torch
    from open_clip_train import scheduler as reference

    optim = parse_train_args(["--lr", "1e-3", "--warmup", "7", "--lr-scheduler", scheduler, *extra]).optim
    steps_per_epoch, total = 10, 100
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    make = {"cosine": reference.cosine_lr, "const": reference.const_lr}
    theirs = make[scheduler](opt, optim.lr, optim.warmup, total) if scheduler in make else (
        reference.const_lr_cooldown(opt, optim.lr, optim.warmup, total, steps_per_epoch * optim.epochs_cooldown,
                                    optim.lr_cooldown_power, optim.lr_cooldown_end))  # fmt: skip
    for step in range(total):
        ours = lr_at(step, optim, total, steps_per_epoch=steps_per_epoch)
        assert ours == pytest.approx(theirs(step), rel=1e-12, abs=1e-15), step


def test_skip_scheduler_keeps_the_lr_from_the_first_step():
    optim = parse_train_args(["--lr", "1e-3", "--skip-scheduler"]).optim
    assert {lr_at(s, optim, 1000) for s in (0, 5, 999)} == {1e-3}
