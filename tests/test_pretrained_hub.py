"""`--pretrained TAG` and `--model hf-hub:ORG/REPO` through `python -m bigclip.train`, offline.

Each test lays out a Hugging Face cache with huggingface_hub's own download code (support/hf_cache.py:
a stand-in Hub on 127.0.0.1 that is stopped before bigclip runs), then trains with HF_HUB_OFFLINE=1,
so the weights can only come from that cache. A run must start from the cached weights (its
checkpoint after one small step is within a step size of them, and not equal: it trained).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from support.hf_cache import populate_cache

from bigclip.models.factory import create_model
from bigclip.weights.sources import open_weights

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-5  # an AdamW step moves a weight by about LR: far less than two initialisations differ


def train(
    demo_data, tmp_path: Path, *argv: str, name: str, env: dict[str, str]
) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "bigclip.train", *argv, "--train-data", demo_data.train_pattern,
        "--train-num-samples", "2", "--batch-size", "2", "--workers", "1", "--epochs", "1",
        "--precision", "fp32", "--lr", str(LR), "--warmup", "1", "--zeroshot-frequency", "0",
        "--val-frequency", "0", "--logs", str(tmp_path / "logs"), "--name", name,
    ]  # fmt: skip
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.run(command, env={**full_env, **env}, capture_output=True, text=True, timeout=900)


def assert_started_from(run_dir: Path, weights: dict[str, torch.Tensor], names: list[str]) -> None:
    """The run's final checkpoint holds `weights` moved by its one small step."""
    reader = open_weights(str(run_dir / "checkpoints")).reader
    moved = []
    for name in names:
        trained = reader.read(f"model.{name}")
        assert (trained - weights[name]).abs().max() < 20 * LR, name  # started from these weights...
        moved.append(not torch.equal(trained, weights[name]))
    assert any(moved)  # ...and trained


def repo_folder(
    tmp_path: Path, files: dict[str, dict[str, torch.Tensor]], config: dict | None = None
) -> Path:
    folder = tmp_path / "repo"
    folder.mkdir()
    for name, state in files.items():
        if name.endswith(".safetensors"):
            save_file(state, folder / name)
        else:
            torch.save(state, folder / name)
    if config is not None:
        (folder / "open_clip_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
def test_vit_b_32_tag_loads_from_the_offline_hugging_face_cache_and_trains(demo_data, tmp_path):
    """The tag's entry names laion/CLIP-ViT-B-32-laion2B-s34B-b79K/ (OpenCLIP's default file name);
    a random ViT-B-32 (151 M parameters) stands in for LAION's weights under HF_HOME's cache."""
    weights = create_model("ViT-B-32", device="cpu", seed=3).state_dict()
    folder = repo_folder(tmp_path, {"open_clip_pytorch_model.bin": weights})
    populate_cache(tmp_path / "hf" / "hub", "laion/CLIP-ViT-B-32-laion2B-s34B-b79K", folder)
    out = train(demo_data, tmp_path, "--model", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k", name="b32",
                env={"HF_HOME": str(tmp_path / "hf")})  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    log = (tmp_path / "logs" / "b32" / "out.log").read_text()
    assert "loaded 302 tensors from --pretrained laion2b_s34b_b79k (ViT-B-32): " in log
    assert "models--laion--CLIP-ViT-B-32-laion2B-s34B-b79K/snapshots/" in log
    names = ["logit_scale", "visual.proj", "visual.conv1.weight", "text_projection", "token_embedding.weight"]
    assert_started_from(tmp_path / "logs" / "b32", weights, names)


ZERO3 = ["--engine", "deepspeed", "--deepspeed-config", str(ROOT / "ds_configs" / "zero3.json")]


@pytest.mark.parametrize("engine", [[], ZERO3], ids=["fsdp", "deepspeed-zero3"])
@pytest.mark.slow
def test_hf_hub_model_loads_its_config_preprocessing_and_weights_offline(demo_data, tmp_path, engine):
    """OpenCLIP's layout: open_clip_config.json (model_cfg + preprocess_cfg) and the weights, the
    safetensors file preferred over open_clip_pytorch_model.bin; --cache-dir names the cache."""
    model_cfg = json.loads((ROOT / "bigclip" / "models" / "configs" / "tiny.json").read_text())
    preprocess = {"mean": [0.3, 0.3, 0.3], "std": [0.2, 0.2, 0.2], "interpolation": "bicubic"}
    safe = create_model("tiny", device="cpu", seed=5).state_dict()
    other = create_model("tiny", device="cpu", seed=6).state_dict()
    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess}
    files = {"open_clip_model.safetensors": safe, "open_clip_pytorch_model.bin": other}
    populate_cache(tmp_path / "cache", "test-org/tiny-clip", repo_folder(tmp_path, files, config))
    argv = ["--model", "hf-hub:test-org/tiny-clip", "--cache-dir", str(tmp_path / "cache"), *engine]
    out = train(demo_data, tmp_path, *argv, name="hub", env={"HF_HOME": str(tmp_path / "empty")})
    assert out.returncode == 0, out.stderr[-4000:]
    log = (tmp_path / "logs" / "hub" / "out.log").read_text()
    assert "from --pretrained hf-hub:test-org/tiny-clip: " in log and "open_clip_model.safetensors" in log
    saved = yaml.safe_load((tmp_path / "logs" / "hub" / "config.yaml").read_text())
    assert (saved["data"]["image_mean"], saved["data"]["image_std"]) == (
        preprocess["mean"],
        preprocess["std"],
    )
    assert_started_from(tmp_path / "logs" / "hub", safe, sorted(safe))


def test_an_uncached_hf_hub_model_fails_offline_saying_how_to_get_it(demo_data, tmp_path):
    argv = ["--model", "hf-hub:test-org/absent", "--cache-dir", str(tmp_path / "cache")]
    out = train(demo_data, tmp_path, *argv, name="absent", env={})
    assert out.returncode == 2
    assert "hf-hub:test-org/absent: cannot get open_clip_config.json" in out.stderr
    assert "with HF_HUB_OFFLINE=1 only files already there are found" in out.stderr
    assert "`hf download test-org/absent`" in out.stderr


RESOLVE = """
import json, sys
from bigclip.cli_args import parse_train_args
from bigclip.errors import BigclipError
from bigclip.weights.named import weights_of
out = []
for argv in json.loads(sys.argv[1]):
    try:
        out.append(weights_of(parse_train_args(argv).model)[0])
    except BigclipError as e:
        out.append(f"{type(e).__name__}: {e}")
print(json.dumps(out))
"""


def test_tag_files_are_found_as_openclip_finds_them(tmp_path):
    """'org/repo/' is OpenCLIP's default file, its safetensors form first; 'org/repo/FILE' likewise;
    a tag whose file is not cached fails saying how to get it."""
    tiny = create_model("tiny", device="cpu").state_dict()
    cache = tmp_path / "cache"
    populate_cache(cache, "laion/CLIP-ViT-B-16-laion2B-s34B-b88K", repo_folder(tmp_path, {"open_clip_model.safetensors": tiny}))  # fmt: skip
    (tmp_path / "repo").rename(tmp_path / "repo-b16")
    populate_cache(cache, "timm/vit_base_patch16_clip_224.openai", repo_folder(tmp_path, {"open_clip_pytorch_model.bin": tiny}))  # fmt: skip
    cases = [["--model", "ViT-B-16", "--pretrained", tag, "--cache-dir", str(cache)]
             for tag in ("laion2b_s34b_b88k", "openai", "datacomp_xl_s13b_b90k")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    safetensors, openai, absent = json.loads(out.stdout)
    assert safetensors.endswith("models--laion--CLIP-ViT-B-16-laion2B-s34B-b88K/snapshots/"
                                f"{Path(safetensors).parent.name}/open_clip_model.safetensors")  # fmt: skip
    assert openai.endswith("/open_clip_pytorch_model.bin") and "vit_base_patch16_clip_224.openai" in openai
    assert absent.startswith("StorageError: hf-hub:laion/CLIP-ViT-B-16-DataComp.XL-s13B-b90K: cannot get ")
    assert "open_clip_pytorch_model.bin" in absent and f"--cache-dir {cache}" in absent
