"""`--pretrained`: OpenCLIP's weight files in every form, into both engines, through the trainer.

OpenCLIP's own CLIP class provides the reference weights (tests/openclip_ref.py). Files are
served over HTTP from 127.0.0.1 and S3 from the loopback server; nothing leaves the machine.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.engine_harness import global_batch
from support.openclip_ref import open_clip_clip
from support.train_harness import demo_argv
from test_engine_deepspeed import DS_CONFIGS
from test_registry import largest_payload

from bigclip.checkpoint import CheckpointStore
from bigclip.cli_args import parse_train_args
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.errors import BigclipError, ConfigError
from bigclip.models.factory import create_model
from bigclip.registry.registry import Registry
from bigclip.weights.consolidate import consolidate
from bigclip.weights.pretrained import match_weights
from bigclip.weights.sources import open_weights


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """OpenCLIP's tiny CLIP, with a distinctive logit scale."""
    model = open_clip_clip("tiny")
    with torch.no_grad():
        model.logit_scale.fill_(2.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def openclip_files(folder: Path, state: dict[str, torch.Tensor]) -> dict[str, Path]:
    """The forms OpenCLIP users have: a training checkpoint (DataParallel prefixes), a plain
    state dict, a torch.compile'd model's state dict, and safetensors."""
    files = {
        "train-checkpoint.pt": {
            "epoch": 3,
            "name": "run",
            "state_dict": {f"module.{k}": v for k, v in state.items()},
        },
        "open_clip_pytorch_model.bin": state,
        "compiled.pth": {f"_orig_mod.{k}": v for k, v in state.items()},
    }
    paths = {}
    for name, obj in files.items():
        torch.save(obj, folder / name)
        paths[name] = folder / name
    save_file(state, folder / "open_clip_model.safetensors")
    paths["open_clip_model.safetensors"] = folder / "open_clip_model.safetensors"
    return paths


def test_every_openclip_form_reads_to_the_same_tensors(reference, tmp_path):
    shapes = {n: tuple(p.shape) for n, p in create_model("tiny", device="meta").named_parameters()}
    for name, path in openclip_files(tmp_path, reference).items():
        source = open_weights(str(path))
        plan = match_weights(source, shapes, model="tiny")
        assert sorted(plan.names) == sorted(shapes), name
        for model_name, source_name in zip(plan.names, plan.source_names):
            assert torch.equal(source.reader.read(source_name), reference[model_name]), (name, model_name)


def test_wrong_architecture_lists_missing_unexpected_and_misshaped_keys(reference, tmp_path):
    state = dict(reference)
    del state["visual.proj"]
    state["visual.extra_head.weight"] = torch.zeros(3)
    state["text_projection"] = torch.zeros(32, 64)
    torch.save({"state_dict": state}, tmp_path / "wrong.pt")
    shapes = {n: tuple(p.shape) for n, p in create_model("tiny", device="meta").named_parameters()}
    with pytest.raises(ConfigError) as info:
        match_weights(open_weights(str(tmp_path / "wrong.pt")), shapes, model="tiny")
    message = str(info.value)
    assert "missing from the weights (1):\n    visual.proj" in message
    assert "unexpected in the weights (1):\n    visual.extra_head.weight" in message
    assert "text_projection: weights (32, 64) vs model (64, 64)" in message


def leases_on(registry: str, name: str) -> int:
    return len(Registry(registry).location.list_files(f"leases/{name}")) if registry else 0


def start_trainer(rank: int, world: int, cases: list[tuple[list[str], str]]) -> list[dict]:
    """Worker: for each case, set up a run (the real trainer's setup), report its weights and
    whether rank 0 held a lease while it lived, then end it."""
    from bigclip.train.trainer import close_run, setup

    out = []
    for argv, registry in cases:
        try:
            run = setup(parse_train_args(argv))
        except BigclipError as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        held = leases_on(registry, "tiny-base")
        weights = run.engine.full_state_dict()
        run.engine.eval()
        with torch.no_grad():  # the compute copies (ZeRO-3: partitioned) see the new weights too
            features = run.engine.forward(*global_batch(0, 4))["image_features"]
        close_run(run)
        out.append({"weights": weights if rank == 0 else None, "features": features,
                    "leases_held": held, "leases_after": leases_on(registry, "tiny-base")})  # fmt: skip
    return out


@pytest.fixture
def http_url(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.dist
def test_pretrained_loads_into_both_engines_through_the_trainer(
    demo_data, reference, tmp_path, http_url, monkeypatch
):
    served, url = http_url
    monkeypatch.setenv("BIGCLIP_CACHE", str(tmp_path / "cache"))  # inherited by the spawned ranks
    openclip_files(served, reference)
    trained = create_model("tiny", device="cpu", seed=7).state_dict()  # another model's weights...
    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"))
    store.save({"model": trained, "train": {"step": 9}}, step=9, meta={"model": "tiny"})  # ...as a checkpoint
    store.close()
    registry = Registry(str(tmp_path / "registry"))
    registry.publish(str(tmp_path / "run" / "checkpoints"), "tiny-base")
    wrong = dict(reference, text_projection=torch.zeros(32, 64))
    torch.save(wrong, served / "wrong.pt")
    damaged = tmp_path / "damaged" / "step_00000009"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_00000009", damaged)
    file, start, size = largest_payload(damaged)
    data = bytearray((damaged / file).read_bytes())
    data[start + size // 2] ^= 1  # found by its CRC-32 after earlier tensors were broadcast
    (damaged / file).write_bytes(bytes(data))
    zero3 = ["--engine", "deepspeed", "--deepspeed-config", str(DS_CONFIGS / "zero3.json")]
    with LoopbackS3() as s3:
        s3.create_bucket("bigclip-weights")
        consolidate(
            str(served / "open_clip_model.safetensors"), "s3://bigclip-weights/tiny/", max_shard_size="2MB"
        )
        cases = [
            (demo_argv(demo_data, tmp_path, "--pretrained", f"{url}/train-checkpoint.pt", name="http"), ""),
            (
                demo_argv(
                    demo_data,
                    tmp_path,
                    "--pretrained",
                    "registry:tiny-base",
                    "--registry",
                    registry.uri,
                    *zero3,
                    name="registry",
                ),
                registry.uri,
            ),  # fmt: skip
            (
                demo_argv(
                    demo_data,
                    tmp_path,
                    "--pretrained",
                    "s3://bigclip-weights/tiny/model.safetensors.index.json",
                    name="s3",
                ),
                "",
            ),  # fmt: skip
            (demo_argv(demo_data, tmp_path, "--pretrained", f"{url}/wrong.pt", name="wrong"), ""),
            (demo_argv(demo_data, tmp_path, "--pretrained", str(damaged), name="damaged"), ""),
        ]
        ranks = spawn(start_trainer, 2, cases)
    http_run, registry_run, s3_run, _, _ = ranks[0]
    for run, expected in ((http_run, reference), (registry_run, trained), (s3_run, reference)):
        assert run["weights"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(run["weights"][key], value), key
        model = create_model("tiny", device="cpu")
        model.load_state_dict(expected)
        with torch.no_grad():
            assert torch.allclose(
                run["features"], model.encode_image(global_batch(0, 4)[0], normalize=True), atol=1e-5
            )
    assert (registry_run["leases_held"], registry_run["leases_after"]) == (1, 0)
    for rank in ranks:  # every rank fails, with the listing
        assert "ConfigError: --pretrained" in rank[3]["error"]
        assert "text_projection: weights (32, 64) vs model (64, 64)" in rank[3]["error"]
    # weights damaged mid-way: rank 0 finds it while loading, every rank stops (none hangs)
    assert f"{file} (byte " in ranks[0][4]["error"] and "CRC-32" in ranks[0][4]["error"]
    assert "StorageError: rank 0 could not read the weights: CheckpointDamaged:" in ranks[1][4]["error"]
