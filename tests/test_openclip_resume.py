"""`--resume epoch_N.pt` of a checkpoint written by OpenCLIP's own code continues in bigclip.

OpenCLIP's `CLIP` (from the installed package) trains a few steps with torch AdamW grouped as
`open_clip_train.main` groups it, and the checkpoint dict is written as its trainer writes it.
bigclip resumes it on 2 ranks through the real training entry point, under FSDP2 and ZeRO-3,
and saves: every weight, Adam moment and step count equals OpenCLIP's, found by name through
the optimizer's own parameter objects (not through bigclip's mapping).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.dcp_harness import whole_checkpoint
from support.engine_harness import global_batch
from support.openclip_ref import open_clip_clip
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
    from bigclip.train.loop import close_run, save_checkpoint, setup

    run = setup(parse_train_args(argv))
    save_checkpoint(run, data_position=None)
    run.store.wait()
    out = {"state": vars(run.state).copy(), "checkpoint": run.store.latest()}
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
    assert restored["state"]["step"] == 3 and restored["state"]["epoch"] == 1
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
