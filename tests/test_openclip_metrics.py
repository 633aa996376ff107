"""bigclip's metrics and their names against OpenCLIP's own trainer (`open_clip_train.main`, run on
CPU in the reference environment on the demo shards, with bigclip's tiny config registered).

OpenCLIP trains one short epoch, evaluates and writes `epoch_1.pt`, TensorBoard and
`results.jsonl`; bigclip evaluates that `epoch_1.pt` with no training data, and trains on 2
ranks for its `train/` scalars (TensorBoard and wandb, offline). Every tag OpenCLIP writes is one
bigclip writes, with the same meaning: the same figures for the same weights (`val/`), the logit
scale exponentiated (`train/scale`), per-GPU throughput per rank, each loss by name and the total;
the console lines carry OpenCLIP's fields. Zero-shot names are zeroshot.py's (test_zeroshot.py):
OpenCLIP's zero-shot always builds its 1,000 ImageNet classes, too slow for a CPU test here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from support.reference_venv import run_reference
from support.train_harness import demo_argv, train_worker
from support.wandb_records import history
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bigclip.distributed import spawn
from bigclip.train.evaluate import retrieval_metrics

pytestmark = pytest.mark.dist

BATCH, STEPS = 32, 2
TRAINER = """
import sys, open_clip
open_clip.add_model_config(sys.argv[1])
from open_clip_train.main import main
main(sys.argv[2:])
"""
# OpenCLIP 3.3.0's webdataset pipeline predates webdataset 1.0's end-of-shard marker (its training
# extra pins webdataset<=0.2.86), and --report-to tensorboard needs tensorboard: `make test`'s
# reference environment has both.
NEEDS = """
import tensorboard, webdataset
from importlib.metadata import version
major, minor, patch = (int(p) for p in version("webdataset").split(".")[:3])
assert (major, minor, patch) <= (0, 2, 86), version("webdataset")
"""


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def openclip(demo_data, module_tmp) -> Path:
    """OpenCLIP's trainer: STEPS steps of BATCH, then its evaluation on the held-out shards."""
    from importlib import resources

    try:
        run_reference(NEEDS)
    except AssertionError:
        message = ("the reference environment lacks tensorboard or webdataset<=0.2.86 (OpenCLIP's pin); "
                   "`make ref-venv` installs them")  # fmt: skip
        pytest.fail(f"CI: {message}") if os.environ.get("CI") else pytest.skip(message)
    logs = module_tmp("openclip-metrics")
    tiny = resources.files("bigclip.models") / "configs" / "tiny.json"
    run_reference(TRAINER, str(tiny), "--model", "tiny", "--train-data", demo_data.train_pattern,
                  "--train-num-samples", str(STEPS * BATCH), "--val-data", demo_data.val_pattern,
                  "--val-num-samples", str(demo_data.val_samples), "--dataset-type", "webdataset",
                  "--batch-size", str(BATCH), "--epochs", "1", "--precision", "fp32", "--workers", "1",
                  "--lr", "1e-3", "--warmup", "1", "--device", "cpu", "--report-to", "tensorboard",
                  "--log-every-n-steps", "1", "--logs", str(logs), "--name", "oc")  # fmt: skip
    return logs / "oc"


@pytest.fixture(scope="module")
def evaluated(openclip, demo_data, module_tmp) -> dict:
    """bigclip, evaluation only: OpenCLIP's epoch_1.pt on the same held-out shards."""
    logs = module_tmp("bigclip-eval")
    argv = ["--model", "tiny", "--precision", "fp32", "--batch-size", str(BATCH), "--workers", "1",
            "--val-data", demo_data.val_pattern, "--resume", str(openclip / "checkpoints" / "epoch_1.pt"),
            "--logs", str(logs), "--name", "ev"]  # fmt: skip
    return spawn(train_worker, 1, argv)[0]


@pytest.fixture(scope="module")
def trained(demo_data, module_tmp) -> dict:
    """bigclip training on 2 ranks, its scalars to TensorBoard and to wandb (offline)."""
    logs = module_tmp("bigclip-train")
    argv = demo_argv(demo_data, logs, "--max-steps", str(STEPS), "--val-frequency", "0", "--log-every-n-steps",
                     "1", "--log-metric-every-n-steps", "1", "--report-to", "tensorboard,wandb", name="tr")  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        return spawn(train_worker, 2, argv)[0]


@pytest.mark.slow
def test_every_openclip_tag_is_a_bigclip_tag(openclip, evaluated, trained):
    theirs = set(scalars(openclip / "tensorboard"))
    compared = {"train/scale", "train/samples_per_second_per_gpu", "train/contrastive_loss", "train/loss",
                "val/clip_val_loss", "val/image_to_text_R@10"}  # fmt: skip
    assert compared <= theirs  # the reference wrote what the tests compare
    train = set(scalars(Path(trained["run_dir"]) / "tensorboard"))
    val = set(scalars(Path(evaluated["run_dir"]) / "tensorboard"))
    assert {t for t in theirs if t.startswith("train/")} <= train
    assert {t for t in theirs if t.startswith("val/")} <= val
    (wandb_file,) = Path(trained["run_dir"]).glob("wandb/offline-run-*-tr/run-tr.wandb")
    logged = set().union(*history(wandb_file))
    assert {t for t in theirs if t.startswith("train/")} <= logged  # wandb gets the same keys


@pytest.mark.slow
def test_train_scalars_mean_what_openclip_means(openclip, trained):
    theirs, ours = scalars(openclip / "tensorboard"), scalars(Path(trained["run_dir"]) / "tensorboard")
    for values in (theirs, ours):  # the logit scale exponentiated (ln(1/0.07) at init: 14.3), not its log
        assert all(10 < v < 20 for _, v in values["train/scale"])
        assert values["train/loss"] == values["train/contrastive_loss"]  # one loss term: the total is it
    per_gpu = dict(ours["train/samples_per_second_per_gpu"])
    assert per_gpu == pytest.approx({s: v / 2 for s, v in ours["train/samples_per_second"]})  # 2 ranks
    assert dict(theirs["train/samples_per_second_per_gpu"]) == dict(theirs["train/samples_per_second"])  # 1


@pytest.mark.slow
def test_the_same_weights_give_openclips_figures(openclip, evaluated):
    (theirs,) = [json.loads(x) for x in (openclip / "checkpoints" / "results.jsonl").read_text().splitlines()]
    ours = json.loads((Path(evaluated["run_dir"]) / "results.jsonl").read_text().splitlines()[-1])
    assert set(theirs) <= set(ours)
    n = theirs["num_samples"]
    for key, value in theirs.items():
        if key.endswith(("R@1", "R@5", "R@10")):
            assert ours[key] == pytest.approx(value, abs=1.01 / n), key  # a near-tie may flip one sample
        elif key.endswith("_rank"):
            assert ours[key] == pytest.approx(value, abs=0.1), key
        else:  # clip_val_loss, epoch, num_samples
            assert ours[key] == pytest.approx(value, rel=1e-4), key
    scalar_tb = scalars(Path(evaluated["run_dir"]) / "tensorboard")
    assert scalar_tb["val/clip_val_loss"][0][1] == pytest.approx(theirs["clip_val_loss"], rel=1e-4)


@pytest.mark.slow
def test_console_lines_carry_openclips_fields(openclip, evaluated, trained):
    loss = re.compile(r"Contrastive_loss: (\S+) \((\S+)\) Loss: (\S+) \((\S+)\)")
    for log in (openclip / "out.log", Path(trained["run_dir"]) / "out.log"):
        lines = [m.groups() for m in map(loss.search, log.read_text().splitlines()) if m]
        assert lines and all(g[:2] == g[2:] for g in lines), log  # each term, then the total
    eval_line = re.compile(r"Eval Epoch: 1 image_to_text_mean_rank: [\d.]+\timage_to_text_median_rank:")
    assert eval_line.search((openclip / "out.log").read_text())
    assert eval_line.search((Path(evaluated["run_dir"]) / "out.log").read_text())


GET_CLIP_METRICS = """
import json, sys, torch
from open_clip_train.train import get_clip_metrics
image, text = torch.load(sys.argv[1])
metrics = get_clip_metrics(image_features=image, text_features=text, logit_scale=torch.tensor(20.0))
print(json.dumps({k: float(v) for k, v in metrics.items()}))
"""


def test_rank_metrics_equal_get_clip_metrics(tmp_path):
    """OpenCLIP's get_clip_metrics itself on features with no ties, every chunking of bigclip's."""
    torch.manual_seed(0)
    image = torch.nn.functional.normalize(torch.randn(300, 16), dim=1)
    text = torch.nn.functional.normalize(image + 0.6 * torch.randn(300, 16), dim=1)
    torch.save((image, text), tmp_path / "features.pt")
    theirs = json.loads(run_reference(GET_CLIP_METRICS, str(tmp_path / "features.pt")))
    assert 0.05 < theirs["image_to_text_R@1"] < 0.95 and theirs["text_to_image_median_rank"] > 1
    for chunk in (0, 7, 300):
        ours = retrieval_metrics(image, text, logit_scale=20.0, batch_size=BATCH, chunk_size=chunk)
        assert {k: ours[k] for k in theirs} == pytest.approx(theirs, abs=1e-12)
