"""The evaluation-only run (OpenCLIP's `--pretrained X --val-data ...` with no `--train-data`):
`bigclip train` without training data, or `bigclip eval`, evaluates the weights it is given and
ends. One short training run makes the weights; the same weights, evaluated through `--resume`
(in the run's own folder) on one rank, through `--pretrained` under torchrun on 2 ranks and
through DeepSpeed ZeRO-3's load path on 2 ranks, give the same retrieval and zero-shot figures.
(OpenCLIP's own trainer, for names and values: test_openclip_metrics.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.bad_input import ROOT
from support.train_harness import demo_argv, train_worker
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_engine_deepspeed import DS_CONFIGS

from bigclip.distributed import spawn
from bigclip.weights.consolidate import consolidate

pytestmark = pytest.mark.dist

RETRIEVAL = [f"{way}_{m}" for way in ("image_to_text", "text_to_image")
             for m in ("mean_rank", "median_rank", "R@1", "R@5", "R@10")]  # fmt: skip
ZERO_SHOT = ["imagenet-zeroshot-val-top1", "imagenet-zeroshot-val-top5"]


def eval_flags(demo_data, logs: Path, name: str) -> list[str]:
    """What an evaluation-only run is given: the model, the evaluation sets, no --train-data."""
    return ["--model", "tiny", "--precision", "fp32", "--batch-size", "32", "--workers", "1",
            "--val-data", demo_data.val_pattern, "--imagenet-val", demo_data.classify_pattern,
            "--logs", str(logs), "--name", name]  # fmt: skip


@pytest.fixture(scope="module")
def trained(demo_data, module_tmp) -> dict:
    """A short training run (its checkpoint committed at the end) and its weights consolidated."""
    logs = module_tmp("eval_only")
    argv = demo_argv(demo_data, logs, "--max-steps", "6", "--val-frequency", "0", name="trained")
    summary = spawn(train_worker, 1, argv)[0]
    weights = logs / "trained.safetensors"
    consolidate(summary["checkpoint"], str(weights))
    return {**summary, "logs": logs, "weights": weights}


@pytest.fixture(scope="module")
def one_rank(trained, demo_data) -> dict:
    """`--resume latest` in the training run's own folder, one rank, through `bigclip train`."""
    argv = [*eval_flags(demo_data, trained["logs"], "trained"), "--resume", "latest"]
    return spawn(train_worker, 1, argv)[0]


def test_resume_latest_evaluates_in_the_run_folder_and_writes_no_checkpoint(trained, one_rank):
    run_dir = Path(trained["run_dir"])
    metrics = one_rank["eval"]
    assert (one_rank["step"], one_rank["epoch"]) == (6, 0)  # the weights the checkpoint holds
    assert set(RETRIEVAL + ZERO_SHOT + ["clip_val_loss", "num_samples", "epoch", "step"]) <= set(metrics)
    assert metrics["num_samples"] == 200 and metrics["image_to_text_R@10"] >= metrics["image_to_text_R@1"]
    assert [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()] == [metrics]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [Path(trained["checkpoint"]).name]  # the one training committed, nothing more
    assert "train_data: ''" in (run_dir / "eval-config.yaml").read_text()
    assert "train_data: ''" not in (run_dir / "config.yaml").read_text()  # the training run's, kept
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val/image_to_text_R@1")] == [6]
    assert "Eval Epoch: 0 imagenet-zeroshot-val-top1: " in (run_dir / "out.log").read_text()


def test_torchrun_two_ranks_evaluate_the_pretrained_weights_the_same(trained, one_rank, demo_data, tmp_path):
    """`torchrun -m bigclip -- eval --pretrained FILE`: the consolidated weights, sharded over 2 ranks."""
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), "--nproc-per-node", "2", "-m", "bigclip", "--", "eval",
            *eval_flags(demo_data, tmp_path, "pretrained"), "--pretrained", str(trained["weights"])]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = (tmp_path / "pretrained" / "results.jsonl").read_text().splitlines()
    assert_same_figures(json.loads(line), one_rank["eval"])
    assert json.loads(line)["epoch"] == 0  # --pretrained weights start at epoch 0, as in OpenCLIP
    assert not list((tmp_path / "pretrained").glob("checkpoints/step_*"))  # an evaluation saves nothing


@pytest.mark.slow
def test_deepspeed_evaluates_the_checkpoint_through_its_own_load_path(trained, one_rank, demo_data, tmp_path):
    argv = [*eval_flags(demo_data, tmp_path, "zero3"), "--resume", trained["checkpoint"],
            "--engine", "deepspeed", "--deepspeed-config", str(DS_CONFIGS / "zero3.json")]  # fmt: skip
    summary = spawn(train_worker, 2, argv)[0]
    assert summary["step"] == 6
    assert_same_figures(summary["eval"], one_rank["eval"])


def assert_same_figures(got: dict, expected: dict) -> None:
    """Same weights, other sharding: ranks and accuracies equal, the loss to float rounding."""
    for key in RETRIEVAL + ZERO_SHOT + ["num_samples"]:
        assert got[key] == pytest.approx(expected[key], abs=1e-9), key
    assert got["clip_val_loss"] == pytest.approx(expected["clip_val_loss"], rel=1e-4)
