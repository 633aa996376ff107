"""`--pretrained FILE` against OpenCLIP's own factory: for the same file,
`open_clip.create_model_and_transforms(name, pretrained=FILE)` (OpenCLIP's whole package, in the
reference environment: support/reference_venv.py) and a bigclip run that loaded the file through
its trainer give the same image and text features. The model is bigclip's tiny config, registered
in OpenCLIP with its own `add_model_config`; the file is an OpenCLIP training checkpoint
(`{"epoch", "state_dict"}` with DataParallel's `module.` prefixes), the form users pass most.
"""

from __future__ import annotations

import pytest
import torch
from support.engine_harness import global_batch
from support.reference_venv import reference_python, run_reference
from support.train_harness import demo_argv

from bigclip.cli_args import parse_train_args
from bigclip.distributed import spawn
from bigclip.models.factory import create_model

REFERENCE = """
import sys, torch, open_clip
config, weights, inputs, out = sys.argv[1:5]
open_clip.add_model_config(config)  # bigclip's tiny.json, OpenCLIP's schema
model, _, _ = open_clip.create_model_and_transforms("tiny", pretrained=weights)
data = torch.load(inputs)
model.eval()
with torch.no_grad():
    torch.save({"image": model.encode_image(data["images"], normalize=True),
                "text": model.encode_text(data["texts"], normalize=True),
                "logit_scale": model.logit_scale.exp()}, out)
"""


def features_after_setup(rank: int, world: int, argv: list[str], inputs: str) -> dict[str, torch.Tensor]:
    """Worker: the trainer's set-up (which loads --pretrained), then the features of `inputs`."""
    from bigclip.train.trainer import close_run, setup

    run = setup(parse_train_args(argv))
    data = torch.load(inputs)
    run.engine.eval()
    with torch.no_grad():
        out = run.engine.forward(data["images"], data["texts"])
    close_run(run)
    return {"image": out["image_features"], "text": out["text_features"], "logit_scale": out["logit_scale"]}


@pytest.mark.dist
def test_openclip_and_bigclip_give_the_same_features_for_the_same_file(demo_data, tmp_path):
    reference_python()  # skips (fails under CI) before any work when the reference is missing
    state = create_model("tiny", device="cpu", seed=11).state_dict()
    state["logit_scale"] = torch.tensor(2.5)  # distinct from the initial value
    weights = tmp_path / "epoch_3.pt"
    torch.save(
        {"epoch": 3, "name": "run", "state_dict": {f"module.{k}": v for k, v in state.items()}}, weights
    )
    images, texts = global_batch(0, 4)
    torch.save({"images": images, "texts": texts}, tmp_path / "inputs.pt")
    config = tmp_path / "tiny.json"
    config.write_text(_tiny_config())
    run_reference(REFERENCE, str(config), str(weights), str(tmp_path / "inputs.pt"), str(tmp_path / "ref.pt"))
    reference = torch.load(tmp_path / "ref.pt")

    argv = demo_argv(demo_data, tmp_path, "--pretrained", str(weights), name="reference")
    ours = spawn(features_after_setup, 2, argv, str(tmp_path / "inputs.pt"))[0]
    for key in ("image", "text", "logit_scale"):
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours["image"], _features_of_initial_model(images))  # the file was read


def _tiny_config() -> str:
    from importlib import resources

    return (resources.files("bigclip.models") / "configs" / "tiny.json").read_text()


def _features_of_initial_model(images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return create_model("tiny", device="cpu").eval().encode_image(images, normalize=True)
