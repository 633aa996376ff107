"""`bigclip consolidate`: sharded checkpoints of both engines at 2 and 3 ranks -> safetensors.

Checkpoints are written by the real engines through CheckpointStore after two optimizer steps
(FSDP2 and DeepSpeed ZeRO-1 and ZeRO-3 at 2 ranks; FSDP2 at 3 ranks, whose shards are uneven).
The consolidated files must hold exactly the engines' own full weights, bit for bit, under
OpenCLIP's names, and load with strict=True into open_clip's CLIP and into bigclip's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support.dcp_harness import whole_checkpoint
from support.engine_harness import make_engine, run_steps
from support.openclip_ref import open_clip_clip
from test_engine_deepspeed import config

from bigclip.checkpoint import CheckpointStore
from bigclip.cli import main as cli
from bigclip.config import TrainConfig
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.errors import StorageError
from bigclip.models.factory import create_model
from bigclip.storage.locations import LocalLocation
from bigclip.storage.ranged_reads import BlobFolder
from bigclip.weights.consolidate import consolidate
from bigclip.weights.dcp_reader import DcpReader

ENGINES_AT_2 = {"fsdp": config("fsdp"), "zero3": config("zero3"), "zero1": config("zero1")}
BATCH = 12


def save_checkpoints(rank: int, world: int, cfg_dicts: dict[str, dict], root: str) -> dict:
    """Worker: per engine, train two steps, save through CheckpointStore; full weights on rank 0."""
    weights = {}
    for name, c in cfg_dicts.items():
        cfg = TrainConfig.from_dict(c).validate()
        engine = make_engine(rank, world, cfg)
        run_steps(engine, cfg, range(2), BATCH)
        store = CheckpointStore(f"{root}/{name}")
        state = {**engine.checkpoint_state(), "train": {"step": 2, "note": "two steps"}}
        store.save(state, step=2, meta={"engine": cfg.engine.engine, "model": "tiny"})
        store.close()
        weights[name] = engine.full_state_dict()
    return weights if rank == 0 else {}


@pytest.fixture(scope="module")
def saved(module_tmp) -> tuple[Path, dict]:
    root = module_tmp("sharded")
    weights = spawn(save_checkpoints, 2, ENGINES_AT_2, str(root))[0]
    weights |= spawn(save_checkpoints, 3, {"fsdp-3": config("fsdp")}, str(root))[0]
    return root, weights


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["fsdp", "zero3", "zero1", "fsdp-3"])
def test_round_trip_is_bit_exact_and_loads_into_openclip(saved, engine, tmp_path):
    root, weights = saved
    out = tmp_path / "tiny.safetensors"
    assert cli(["consolidate", str(root / engine), str(out), "--no-progress"]) == 0
    state = load_file(out)
    assert state.keys() == weights[engine].keys()
    for key, value in weights[engine].items():
        assert torch.equal(state[key], value), key
    create_model("tiny", device="cpu").load_state_dict(state, strict=True)
    open_clip_clip("tiny").load_state_dict(state, strict=True)
    manifest = json.loads((tmp_path / "tiny.manifest.json").read_text())
    assert manifest["model"] == "tiny" and manifest["step"] == 2
    assert manifest["files"]["tiny.safetensors"]["size"] == out.stat().st_size


@pytest.mark.dist
def test_with_optimizer_sharded_bf16_matches_dcp_reader(saved, tmp_path):
    """Shards + index, weights in bf16, Adam state in fp32, param groups and train state as JSON."""
    root, weights = saved
    result = consolidate(str(root / "zero3"), str(tmp_path / "out"), dtype="bf16", max_shard_size="1MB",
                         with_optimizer=True)  # fmt: skip
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 3 and files == sorted(n for n in result.records if n.endswith(".safetensors"))
    state = {}
    for f in files:
        state |= load_file(tmp_path / "out" / f)
    reference = whole_checkpoint(root / "zero3" / "step_00000002")
    for key, value in reference.items():
        if key.startswith("model."):
            assert torch.equal(state[key[6:]], value.to(torch.bfloat16)), key
        elif torch.is_tensor(value):
            assert torch.equal(state[key], value), key
    with safe_open(tmp_path / "out" / files[0], "pt") as f:
        extra = json.loads(f.metadata()["bigclip.state"])
    assert extra["train.step"] == 2 and extra["train.note"] == "two steps"
    assert "visual.conv1.weight" in extra["optim.optimizer.param_groups.1.params"]


def storage_of(folder: Path, key: str):  # noqa: ANN201 (DCP's _StorageInfo)
    """Where the first chunk of `key` is stored (file, offset, length)."""
    metadata = DcpReader(BlobFolder(LocalLocation(folder))).metadata
    return next(info for index, info in metadata.storage_data.items() if index.fqn == key)


@pytest.mark.dist
def test_damaged_objects_fail_with_the_object_named(saved, tmp_path):
    root, _ = saved
    folder = tmp_path / "copy"
    os.system(f"cp -r {root / 'fsdp'}/step_00000002 {folder}")
    chunk = storage_of(folder, "model.token_embedding.weight")
    victim = folder / chunk.relative_path
    data = bytearray(victim.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0xFF  # inside the payload: caught by the chunk's CRC-32
    victim.write_bytes(bytes(data))
    out = tmp_path / "out" / "model.safetensors"
    with pytest.raises(StorageError, match=victim.name):
        consolidate(str(folder), str(out))
    assert not any(p.name.endswith(".safetensors") for p in out.parent.iterdir())  # nothing final
    assert not list(out.parent.glob(".*partial*"))  # and no temporary left behind
    victim.write_bytes(bytes(data[: len(data) - 100]))  # truncated: caught before any read
    with pytest.raises(StorageError, match=f"{victim.name}: .* manifest says"):
        consolidate(str(folder), str(out))


@pytest.mark.dist
def test_refuses_to_overwrite_and_reports_bad_options(saved, tmp_path):
    root, _ = saved
    out = tmp_path / "model.safetensors"
    consolidate(str(root / "fsdp"), str(out))
    with pytest.raises(StorageError, match="exist; pass --overwrite"):
        consolidate(str(root / "fsdp"), str(out))
    assert cli(["consolidate", str(root / "fsdp"), str(out), "--max-shard-size", "5 parsecs"]) == 2
    assert cli(["consolidate", str(tmp_path / "nothing-here"), str(tmp_path / "x.safetensors")]) == 2


@pytest.fixture(scope="module")
def s3_checkpoint(saved) -> Iterator[str]:
    """The 2-rank FSDP2 checkpoint on the loopback S3 server."""
    root, _ = saved
    with LoopbackS3() as s3:
        s3.create_bucket("bigclip-consolidate")
        for path in (root / "fsdp" / "step_00000002").iterdir():
            s3.client().upload_file(str(path), "bigclip-consolidate", f"run/step_00000002/{path.name}")
        yield "s3://bigclip-consolidate/run"


@pytest.mark.dist
def test_killed_consolidation_leaves_no_file_that_looks_complete(s3_checkpoint, saved, tmp_path):
    """SIGKILL mid-stream (reading from S3, writing locally): only a hidden `.partial` file is
    left, never model.safetensors or its manifest; a rerun completes."""
    out = tmp_path / "model.safetensors"
    command = [sys.executable, "-m", "bigclip.cli", "consolidate", s3_checkpoint, str(out), "--no-progress",
               "--piece-size", "64KiB", "--read-ahead", "1"]  # fmt: skip
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".model.safetensors.partial-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "consolidation never started writing"
        time.sleep(0.005)
    proc.kill()
    assert proc.wait() == -signal.SIGKILL, "consolidation finished before it could be interrupted"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == []
    assert cli(["consolidate", s3_checkpoint, str(out), "--no-progress"]) == 0
    assert load_file(out).keys() == saved[1]["fsdp"].keys()
