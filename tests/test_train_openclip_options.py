"""OpenCLIP trainer options with real behaviour, on one real training run over demo data:
--report-to wandb (offline), --val-frequency, the const-cooldown schedule, --log-local,
--force-image-size/--force-context-length; and the tokenizer recorded with the weights and
checked on --resume and --pretrained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.train_harness import demo_argv, train_worker
from support.wandb_records import history, run_info
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bigclip.cli_args import parse_train_args
from bigclip.distributed import spawn
from bigclip.train.schedule import lr_at
from bigclip.weights.consolidate import consolidate
from bigclip.weights.safetensors_format import SafetensorsReader
from bigclip.weights.sources import open_weights, weights_tokenizer

pytestmark = pytest.mark.dist

STEPS_PER_EPOCH = 8  # 256 samples per epoch / batch 32


@pytest.fixture(scope="module")
def trained(demo_data, module_tmp):
    tmp = module_tmp("openclip_options")
    argv = demo_argv(
        demo_data, tmp, "--train-num-samples", "256", "--epochs", "3", "--val-frequency", "2",
        "--lr-scheduler", "const-cooldown", "--epochs-cooldown", "1", "--warmup", "2",
        "--lr-cooldown-end", "1e-4", "--lr-cooldown-power", "2", "--log-every-n-steps", "1",
        "--report-to", "wandb,tensorboard", "--wandb-project-name", "bigclip-test", "--wandb-notes", "offline",
        "--log-local", "--force-image-size", "48", "--force-context-length", "40", name="oc",
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        summary = spawn(train_worker, 1, argv)[0]
    return summary, argv, tmp


def test_wandb_offline_run_has_the_scalars_and_the_config(trained):
    summary, _, _ = trained
    (path,) = Path(summary["run_dir"]).glob("wandb/offline-run-*-oc/run-oc.wandb")
    info = run_info(path)
    assert (info["id"], info["name"], info["project"], info["notes"]) == (
        "oc",
        "oc",
        "bigclip-test",
        "offline",
    )
    assert info["config"]["data"]["tokenizer"] == "open_clip"
    rows = history(path)
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    assert any("val/image_to_text_R@1" in r for r in rows)


def test_lr_follows_the_cooldown_schedule_and_evaluation_its_frequency(trained):
    summary, argv, _ = trained
    run_dir = Path(summary["run_dir"])
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    optim = parse_train_args(argv).optim
    logged = {e.step: e.value for e in events.Scalars("train/lr")}
    expected = {s: lr_at(s - 1, optim, 3 * STEPS_PER_EPOCH, steps_per_epoch=STEPS_PER_EPOCH) for s in logged}
    assert logged == pytest.approx(expected, rel=1e-6) and len(logged) == 24
    assert logged[1] == pytest.approx(optim.lr / 2) and logged[16] == pytest.approx(optim.lr)
    assert (
        logged[17] == pytest.approx(optim.lr) and logged[24] < logged[20] < logged[18] < optim.lr
    )  # last epoch
    evaluated = [json.loads(line)["epoch"] for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert evaluated == [2, 3]  # --val-frequency 2: epoch 2, and the last one


def test_log_local_writes_the_node_masters_log(trained):
    run_dir = Path(trained[0]["run_dir"])
    assert "Train Epoch: 2" in (run_dir / "out-0.log").read_text()


def test_forced_sizes_and_tokenizer_travel_with_the_weights(trained, tmp_path):
    summary, _, _ = trained
    manifest = json.loads((Path(summary["checkpoint"]) / "manifest.json").read_text())
    assert manifest["meta"]["tokenizer"] == "open_clip"
    out = tmp_path / "model.safetensors"
    consolidate(summary["checkpoint"], str(out))
    source = open_weights(str(out))
    assert isinstance(source.reader, SafetensorsReader)
    assert (
        source.reader.metadata["bigclip.tokenizer"] == "open_clip"
        and weights_tokenizer(source) == "open_clip"
    )
    shapes = {t.name: t.shape for t in source.reader.tensors()}
    assert shapes["visual.positional_embedding"] == (37, 64)  # (48 / 8) ** 2 patches + class token
    assert shapes["positional_embedding"] == (40, 64)


@pytest.mark.parametrize("how", ["--resume", "--pretrained"])
def test_weights_of_another_tokenizer_are_refused_unless_asked(trained, tmp_path, how):
    summary, argv, _ = trained
    source = summary["checkpoint"]
    if how == "--pretrained":
        source = str(tmp_path / "model.safetensors")
        consolidate(summary["checkpoint"], source)
    cmd = [*argv, "--report-to", "", "--logs", str(tmp_path), "--tokenizer", "hashing", how, source]
    proc = subprocess.run(
        [sys.executable, "-m", "bigclip.train", *cmd], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--tokenizer open_clip" in proc.stderr and "--allow-tokenizer-change" in proc.stderr
