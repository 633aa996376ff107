"""A storage scheme added from outside bigclip: fsspec's in-memory filesystem as `memory://`.

The one registration below (`register_scheme("memory", FsspecLocation)`) is all it takes, with no
other change to bigclip, for a real training run to read its webdataset shards from memory://,
write its checkpoints there (DCP through fsspec, hashed on the way, manifest last), resume from
them, and publish a checkpoint to a registry there. Before the registration the same URIs are
refused in one line. fsspec's memory filesystem lives in one process, so the whole story runs in
one spawned rank (its data worker is forked and sees the same memory).
"""

from __future__ import annotations

from typing import Any

import pytest

from bigclip.checkpoint import CheckpointStore
from bigclip.cli_args import parse_train_args
from bigclip.demo.shapes_data import write_demo_data
from bigclip.distributed import spawn
from bigclip.errors import StorageError
from bigclip.registry.registry import Registry
from bigclip.storage.fsspec_location import FsspecLocation
from bigclip.storage.locations import open_location
from bigclip.storage.s3 import S3Settings
from bigclip.storage.schemes import register_scheme, unregister_scheme
from bigclip.storage.settings import StorageState, storage_configured
from bigclip.train.trainer import train
from bigclip.weights.sources import open_weights

pytestmark = pytest.mark.dist

DATA, CHECKPOINTS, REGISTRY = (
    "memory://scheme-test/data",
    "memory://scheme-test/ckpt",
    "memory://scheme-test/reg",
)


def _argv(logs: str, *extra: str) -> list[str]:
    return [
        "--model", "tiny", "--train-data", f"{DATA}/train/{{00000..00001}}.tar", "--precision", "fp32",
        "--batch-size", "16", "--workers", "1", "--epochs", "1", "--lr", "2e-3", "--warmup", "2",
        "--log-every-n-steps", "2", "--logs", logs, "--name", "memory", "--checkpoint-dir", CHECKPOINTS,
        "--save-every-n-steps", "3", *extra,
    ]  # fmt: skip


def _refused_before_registering() -> str:
    try:
        CheckpointStore(CHECKPOINTS)
    except StorageError as e:
        return str(e)
    return ""


def _train_checkpoint_resume_publish(rank: int, world: int, logs: str) -> dict[str, Any]:
    refused = _refused_before_registering()
    register_scheme("memory", FsspecLocation)  # the registration: nothing else changes
    write_demo_data(DATA, samples=192, shards=2, val_samples=0, classify_samples=0, image_size=64)
    first = train(parse_train_args(_argv(logs, "--max-steps", "6")))
    store = CheckpointStore(CHECKPOINTS)
    committed = [step for step, _ in store.committed()]
    store.verify("latest")  # every object re-read and checked against the manifest's SHA-256
    resumed = train(parse_train_args(_argv(logs, "--max-steps", "9", "--resume", "latest")))
    registry = Registry(REGISTRY)
    published = registry.publish(f"{CHECKPOINTS}/step_00000009/", "tiny-from-memory")
    registry.verify("tiny-from-memory")
    weights = open_weights("registry:tiny-from-memory", registry=REGISTRY)
    return {
        "refused": refused,
        "first": first,
        "committed": committed,
        "resumed": resumed,
        "published": (published.kind, published.step, published.uri),
        "weights": (weights.kind, weights.step, len(weights.reader.tensors(weights.prefix))),
        "memory_files": sorted(FsspecLocation("memory://scheme-test").list_files("")),
    }


def test_a_registered_fsspec_scheme_trains_checkpoints_resumes_and_publishes(tmp_path):
    result = spawn(_train_checkpoint_resume_publish, 1, str(tmp_path / "logs"))[0]
    log = (tmp_path / "logs" / "memory" / "out.log").read_text()
    assert f"loaded checkpoint step 6 (saved at world size 1) from {CHECKPOINTS}/step_00000006" in log
    assert "no storage scheme 'memory' is registered" in result["refused"]
    assert result["first"]["step"] == 6 and result["first"]["checkpoint"] == f"{CHECKPOINTS}/step_00000006"
    assert result["committed"] == [6, 3]  # newest first
    assert result["resumed"]["step"] == 9  # continued from step 6, read back from memory://
    assert result["resumed"]["checkpoint"] == f"{CHECKPOINTS}/step_00000009"
    assert result["published"] == ("dcp", 9, f"{REGISTRY}/checkpoints/tiny-from-memory")
    kind, step, tensors = result["weights"]
    assert (kind, step) == ("dcp", 9) and tensors > 10
    files = result["memory_files"]
    assert "data/train/00000.tar" in files and "data/train/sizes.json" in files
    assert (
        "ckpt/step_00000009/manifest.json" in files
        and "reg/checkpoints/tiny-from-memory/published.json" in files
    )
    assert not any(".partial-" in f for f in files)  # every sink committed or aborted its temporary object


def _open_after_restoring(rank: int, world: int, state: StorageState) -> tuple[str, str]:
    state.restore()  # what a data worker does first (data/worker.py); a fresh process knows neither
    return type(open_location("memory://restored/x")).__name__, S3Settings.resolve().endpoint or ""


def test_a_spawned_process_restores_registered_schemes_and_settings():
    """Data workers are spawned where fork is not the default: the state they restore pickles."""
    with storage_configured(s3_endpoint="http://127.0.0.1:9"):
        register_scheme("memory", FsspecLocation)
        try:
            state = StorageState.capture()
        finally:
            unregister_scheme("memory")
    assert spawn(_open_after_restoring, 1, state)[0] == ("FsspecLocation", "http://127.0.0.1:9")
