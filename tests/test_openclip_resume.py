"""`--resume epoch_N.pt` of a checkpoint written by OpenCLIP's own code continues in bigclip.

OpenCLIP's `CLIP` (from the installed package) trains a few steps with torch AdamW grouped as
`open_clip_train.main` groups it, and the checkpoint dict is written as its trainer writes it.
bigclip resumes it on 2 ranks through the real training entry point, under FSDP2 and ZeRO-3,
and saves: every weight, Adam moment and step count equals OpenCLIP's, found by name through
the optimizer's own parameter objects (not through bigclip's mapping). A checkpoint written by
OpenCLIP's trainer itself (`open_clip_train.main`, in the reference environment) resumes at half
and at double its global batch and trains exactly the epochs that remain, from OpenCLIP's LR.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from support.dcp_harness import whole_checkpoint
from support.engine_harness import global_batch
from support.launch_harness import read_keys, srun_like, wait_all
from support.openclip_ref import missing_reference, open_clip_clip
from support.reference_venv import run_reference
from support.train_harness import demo_argv
from test_engine_deepspeed import DS_CONFIGS

from bigclip.distributed import spawn

pytestmark = pytest.mark.dist


def openclip_run(path: Path, *, lock_image_groups: int | None, ddp_prefix: bool, steps: int = 3) -> dict:
    """OpenCLIP's model and optimizer, trained a few steps; its checkpoint written to `path`."""
    torch.manual_seed(0)
    model = open_clip_clip("tiny", output_dict=True)
    import open_clip.loss  # the package is registered by open_clip_clip, without open_clip/__init__

    if lock_image_groups is not None:
        model.lock_image_tower(unlocked_groups=lock_image_groups)
    # open_clip_train/main.py, verbatim in substance:
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if exclude(n, p) and p.requires_grad], "weight_decay": 0.0},
        {"params": [p for n, p in named if not exclude(n, p) and p.requires_grad], "weight_decay": 0.2},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    loss_fn = open_clip.loss.ClipLoss()
    for step in range(steps):
        out = model(*global_batch(step, 8))
        loss_fn(out["image_features"], out["text_features"], out["logit_scale"]).backward()
        optimizer.step()
        optimizer.zero_grad()
    state_dict = model.state_dict()
    if ddp_prefix:  # saved from a DistributedDataParallel wrapper, as older OpenCLIP releases did
        state_dict = {f"module.{k}": v for k, v in state_dict.items()}
    checkpoint = {
        "epoch": 1,
        "name": "openclip-run",
        "state_dict": state_dict,
        "optimizer": optimizer.state_dict(),
    }
    checkpoint["scaler"] = torch.amp.GradScaler("cpu").state_dict()  # what --precision amp adds
    torch.save(checkpoint, path)
    names = {id(p): n for n, p in named}
    moments = {
        names[id(p)]: {k: optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq", "step")}
        for g in optimizer.param_groups
        for p in g["params"]
    }
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "moments": moments}


def resume_and_save(rank: int, world: int, argv: list[str]) -> dict:
    """Worker: the training set-up with --resume, then a checkpoint of what it restored."""
    from bigclip.cli_args import parse_train_args
    from bigclip.train.trainer import close_run, setup

    run = setup(parse_train_args(argv))
    run.checkpointer.save(run.progress.state, data_position=None)
    run.checkpointer.wait()
    out = {"state": vars(run.progress.state).copy(), "checkpoint": run.checkpointer.latest()}
    close_run(run)
    return out


CASES = {
    "fsdp, DDP prefix": ([], None, True),
    "zero3, locked image tower": (
        [
            "--engine",
            "deepspeed",
            "--deepspeed-config",
            str(DS_CONFIGS / "zero3.json"),
            "--lock-image",
            "--lock-image-unlocked-groups",
            "1",
        ],  # fmt: skip
        1,
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_openclip_checkpoint_resumes_on_two_ranks_with_equal_moments(demo_data, tmp_path, case):
    flags, lock_groups, prefix = CASES[case]
    reference = openclip_run(tmp_path / "epoch_1.pt", lock_image_groups=lock_groups, ddp_prefix=prefix)
    argv = demo_argv(demo_data, tmp_path, "--resume", str(tmp_path / "epoch_1.pt"), *flags)
    restored = spawn(resume_and_save, 2, argv)[0]
    assert restored["state"]["epoch"] == 1  # the step follows once the loader is built (below)
    saved = whole_checkpoint(Path(restored["checkpoint"]))
    for name, value in reference["weights"].items():
        assert torch.equal(saved[f"model.{name}"], value), name
    optim = {k.removeprefix("optim.optimizer.state."): v for k, v in saved.items() if ".state." in k}
    assert {k.rsplit(".", 1)[0] for k in optim} == set(reference["moments"])  # frozen ones hold none
    for name, moments in reference["moments"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim[f"{name}.{key}"], moments[key]), (name, key)
        assert int(optim[f"{name}.step"]) == int(moments["step"]), name


def test_a_different_lock_is_refused_with_what_to_do(demo_data, tmp_path):
    openclip_run(tmp_path / "epoch_1.pt", lock_image_groups=0, ddp_prefix=False)
    argv = demo_argv(demo_data, tmp_path, "--resume", str(tmp_path / "epoch_1.pt"))
    with pytest.raises(RuntimeError, match="--lock-image/--lock-text options the OpenCLIP run used"):
        spawn(resume_and_save, 1, argv)


# OpenCLIP's own trainer on its synthetic data, with bigclip's tiny config registered in its
# model registry (same JSON schema): a real `epoch_1.pt` as `open_clip_train.main` writes it.
TRAINER = """
import sys, open_clip
open_clip.add_model_config(sys.argv[1])
from open_clip_train.main import main
main(sys.argv[2:])
"""
OPENCLIP_BATCH, SAMPLES, LR, WARMUP, EPOCHS = 4, 32, 1e-3, 2, 3


@pytest.fixture(scope="module")
def trainer_checkpoint(module_tmp) -> Path:
    from importlib import resources

    logs = module_tmp("openclip-trainer")
    tiny = resources.files("bigclip.models") / "configs" / "tiny.json"
    needs = "import braceexpand, pandas, webdataset"  # open_clip_train.data's imports
    try:
        run_reference(needs)
    except AssertionError:
        missing_reference(f"OpenCLIP's trainer dependencies ({needs}) in the reference environment")
    run_reference(TRAINER, str(tiny), "--model", "tiny", "--dataset-type", "synthetic", "--device", "cpu",
                  "--train-num-samples", str(SAMPLES), "--batch-size", str(OPENCLIP_BATCH), "--epochs", "1",
                  "--precision", "fp32", "--workers", "0", "--lr", str(LR), "--warmup", str(WARMUP),
                  "--save-frequency", "1", "--report-to", "", "--logs", str(logs), "--name", "oc")  # fmt: skip
    return logs / "oc" / "checkpoints" / "epoch_1.pt"


def openclip_lr(step: int, *, total_steps: int) -> float:
    """OpenCLIP's learning rate at `step`, from its own scheduler (open_clip_train/scheduler.py)."""
    if importlib.util.find_spec("open_clip_train") is None:
        missing_reference("open_clip_train (installed with open_clip_torch)")
    from open_clip_train.scheduler import cosine_lr

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    cosine_lr(optimizer, LR, WARMUP, total_steps)(step)
    return optimizer.param_groups[0]["lr"]


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


@pytest.mark.slow
@pytest.mark.parametrize(("batch", "world"), [(2, 1), (4, 2)], ids=["half the global batch", "double"])
def test_an_openclip_trainer_checkpoint_resumes_at_another_global_batch(
    demo_data, tmp_path, trainer_checkpoint, batch, world
):
    """OpenCLIP's trainer places epoch E at step E x batches per epoch under the current flags; AdamW's
    step count (here OpenCLIP's 8 steps of batch 4) is only its bias correction."""
    steps_per_epoch = SAMPLES // (batch * world)
    argv = demo_argv(demo_data, tmp_path, "--resume", str(trainer_checkpoint), "--batch-size", str(batch),
                     "--train-num-samples", str(SAMPLES), "--epochs", str(EPOCHS), "--lr", str(LR),
                     "--warmup", str(WARMUP), "--log-every-n-steps", "1", "--val-frequency", "0",
                     "--save-frequency", "0", "--batch-keys-file", str(tmp_path / "keys"), name="resumed")  # fmt: skip
    assert wait_all(srun_like(argv, world, tmp_path)) == [0] * world, (tmp_path / "rank0.log").read_text()[
        -3000:
    ]
    log = (tmp_path / "resumed" / "out.log").read_text()
    epochs = [int(e) for e in re.findall(r"Train Epoch: (\d+) ", log)]
    assert epochs == [1] * steps_per_epoch + [2] * steps_per_epoch  # epochs 1..N-1, each whole, once
    for rank in range(world):
        assert sorted(read_keys(tmp_path / "keys", rank)) == list(
            range(steps_per_epoch, EPOCHS * steps_per_epoch)
        )
    lrs = tensorboard_scalars(tmp_path / "resumed" / "tensorboard", "train/lr")  # at the step just taken
    first = openclip_lr(steps_per_epoch, total_steps=EPOCHS * steps_per_epoch)
    assert lrs[steps_per_epoch + 1] == pytest.approx(first, rel=1e-6)
    assert first != pytest.approx(openclip_lr(8, total_steps=EPOCHS * steps_per_epoch))  # not AdamW's step
