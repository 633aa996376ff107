"""`bigclip consolidate SRC --open-clip-dir DIR` against OpenCLIP's own loader.

A checkpoint written by FSDP2 at 2 ranks after a few steps is exported; OpenCLIP (its whole
package, in the reference environment: see support/reference_venv.py) loads DIR through
`create_model_and_transforms('local-dir:DIR')` and `get_tokenizer('local-dir:DIR')` with no
network, and gives the same image and text features as bigclip's model, the same preprocessing,
and the tokenizer files hold its tokenizer's ids and merges.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image
from support.engine_harness import global_batch, make_engine, run_steps
from support.reference_venv import reference_python, run_reference
from test_engine_deepspeed import config

from bigclip.checkpoint import CheckpointStore
from bigclip.config import TrainConfig
from bigclip.data.bpe_tokenizer import ClipBpeTokenizer
from bigclip.data.device import ImageNormalizer
from bigclip.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, eval_transform
from bigclip.demo.shapes_data import Attributes, draw
from bigclip.distributed import spawn
from bigclip.errors import ConfigError
from bigclip.models.factory import create_model
from bigclip.weights.consolidate_command import main as consolidate_main

pytestmark = pytest.mark.dist

REFERENCE = """
import json, sys, torch, open_clip
from PIL import Image
folder, inputs, out = sys.argv[1:4]
model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + folder)
tokenizer = open_clip.get_tokenizer("local-dir:" + folder)
data = torch.load(inputs)
model.eval()
with torch.no_grad():
    image = model.encode_image(data["images"], normalize=True)
    text = model.encode_text(data["texts"], normalize=True)
vocab = json.load(open(folder + "/vocab.json"))
merges = open(folder + "/merges.txt").read().splitlines()[1:]
special = {"<|startoftext|>": "<start_of_text>", "<|endoftext|>": "<end_of_text>"}
torch.save({
    "image": image, "text": text, "tokenizer": type(tokenizer).__name__,
    "context_length": tokenizer.context_length, "pixels": preprocess(Image.open(data["picture"])),
    "tokens": tokenizer(data["strings"]),
    "vocab_equal": {special.get(k, k): v for k, v in vocab.items()} == tokenizer.encoder,
    "merges_equal": {tuple(m.split()): i for i, m in enumerate(merges)} == tokenizer.bpe_ranks,
}, out)
"""


def train_and_save(rank: int, world: int, cfg_dict: dict, root: str) -> dict:
    """Worker: a few FSDP2 steps, then two committed checkpoints: one as an OpenCLIP-tokenizer run
    would hold it, one whose saved config names bigclip's hashing tokenizer."""
    cfg = TrainConfig.from_dict(cfg_dict).validate()
    engine = make_engine(rank, world, cfg)
    run_steps(engine, cfg, range(3), 8)
    store = CheckpointStore(root)
    store.save(engine.checkpoint_state(), step=3, meta={"model": "tiny"})
    hashing = {"config": json.dumps({"data": {"tokenizer": "hashing"}})}
    store.save({**engine.checkpoint_state(), "train": hashing}, step=4, meta={"model": "tiny"})
    weights = engine.full_state_dict()
    store.close()
    return {"weights": weights, "checkpoints": [uri for _, uri in store.committed()]}


def test_exported_folder_loads_in_open_clip_with_the_same_features(tmp_path):
    reference_python()  # skips (fails under CI) before any work when the reference is missing
    saved = spawn(train_and_save, 2, config("fsdp"), str(tmp_path / "ckpt"))[0]
    hashing_run, openclip_run = saved["checkpoints"]  # newest first
    folder = tmp_path / "export"
    assert consolidate_main([openclip_run, "--open-clip-dir", str(folder), "--no-progress"]) == 0
    assert {p.name for p in folder.iterdir()} >= {"open_clip_config.json", "open_clip_model.safetensors"}
    written = json.loads((folder / "open_clip_config.json").read_text())
    assert written["model_cfg"]["vision_cfg"]["image_size"] == 64
    assert written["preprocess_cfg"]["resize_mode"] == "shortest"

    model = create_model("tiny", device="cpu").eval()
    model.load_state_dict(saved["weights"], strict=True)
    images, texts = global_batch(0, 4)
    picture = tmp_path / "picture.png"
    draw(Attributes("large", "red", "circle", "center", "black"), image_size=90, rng=random.Random(0)).save(
        picture
    )
    strings = ["a large red circle at the center", "Ünïcode ☃ &amp; <b>html</b>  spaces", ""]
    inputs = {"images": images, "texts": texts, "picture": str(picture), "strings": strings}
    torch.save(inputs, tmp_path / "inputs.pt")
    run_reference(REFERENCE, str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / "reference.pt"))
    reference = torch.load(tmp_path / "reference.pt")
    with torch.no_grad():
        torch.testing.assert_close(
            reference["image"], model.encode_image(images, normalize=True), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            reference["text"], model.encode_text(texts, normalize=True), rtol=1e-5, atol=1e-5
        )
    assert reference["tokenizer"] == "SimpleTokenizer" and reference["context_length"] == 32
    assert reference["vocab_equal"] and reference["merges_equal"]
    assert torch.equal(reference["tokens"], ClipBpeTokenizer(context_length=32)(strings))
    ours = torch.from_numpy(np.array(eval_transform(64)(Image.open(picture))))[
        None
    ]  # uint8, normalised on the device
    normalize = ImageNormalizer(mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)
    torch.testing.assert_close(reference["pixels"], normalize(ours)[0], rtol=0, atol=1e-5)

    with pytest.raises(ConfigError, match="trained with --tokenizer hashing"):
        consolidate_main([hashing_run, "--open-clip-dir", str(tmp_path / "refused"), "--no-progress"])
    assert not (tmp_path / "refused").exists()
