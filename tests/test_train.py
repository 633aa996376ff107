"""The training entry point end to end on demo data, over real gloo ranks."""

import math
from pathlib import Path

import pytest
from support.train_harness import demo_argv, train_worker
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bigclip.distributed import spawn

pytestmark = pytest.mark.dist


def test_two_ranks_learn_and_log(demo_data, tmp_path):
    summary = spawn(train_worker, 2, demo_argv(demo_data, tmp_path, "--max-steps", "60", "--epochs", "3"))[0]
    assert summary["step"] == 60
    metrics = summary["eval"]
    assert metrics["num_samples"] == 200
    # 60 steps of a tiny model already separate the captions far beyond chance (1/200)
    assert metrics["image_to_text_R@1"] > 5 * metrics["chance"]
    assert metrics["text_to_image_R@1"] > 5 * metrics["chance"]
    run_dir = Path(summary["run_dir"])
    log = (run_dir / "out.log").read_text()
    assert "Train Epoch: 0 [" in log and "/s/gpu LR:" in log
    assert "Contrastive_loss:" in log and " Loss: " in log  # OpenCLIP's: each loss term, then the total
    assert "Data (t): " in log and "Loader capacity: " in log
    assert (
        "Model TFLOP/s/gpu: " in log and " ETA: " in log and "MFU" not in log
    )  # a CPU has no datasheet peak
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/scale", "train/samples_per_second", "train/data_time",
            "train/peak_memory_gb", "train/data_capacity_per_gpu", "val/image_to_text_R@1",
            "train/tflops_per_gpu", "train/eta_hours"} <= tags  # fmt: skip
    assert "train/mfu" not in tags
    eta = [e.value for e in events.Scalars("train/eta_hours")]
    assert eta[0] > 0 and eta[-1] == 0  # counts down to the last step
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses[-1] < losses[0]
    assert (run_dir / "config.yaml").exists() and (run_dir / "results.jsonl").exists()


@pytest.mark.parametrize("world", [1, 2])
def test_switchback_trains_like_plain_linears(demo_data, tmp_path, world):
    """Issue 6: the tiny CLIP on demo data with SwitchBack ends within 5% of the plain run's loss."""
    steps = ["--max-steps", "24"]
    plain = spawn(train_worker, world, demo_argv(demo_data, tmp_path, *steps, name="plain"))[0]
    int8 = spawn(train_worker, world, demo_argv(demo_data, tmp_path, *steps, "--int8", "switchback-global",
                                                name="int8"))[0]  # fmt: skip
    chance_loss = math.log(32 * world)  # CLIP loss of an untrained model: log(global batch)
    assert plain["loss"] < 0.85 * chance_loss  # it learned something, so the comparison means something
    assert int8["loss"] == pytest.approx(plain["loss"], rel=0.05)
