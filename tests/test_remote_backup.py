"""OpenCLIP's remote-training workflow through the real trainer (`python -m bigclip.train`):
fast local disk + --remote-sync to S3, a spot interruption, --resume latest; and the traps
around it, each of which used to fail silently."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.dcp_harness import whole_checkpoint
from support.launch_harness import srun_like, wait_all
from support.s3_fault_proxy import FaultProxy

from bigclip.cli_args import parse_train_args
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.errors import ConfigError

BUCKET = "backup-tests"


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket(BUCKET)
        yield server


def argv(demo_data, logs: Path, name: str, *extra: str) -> list[str]:
    return [
        "--model", "tiny", "--train-data", demo_data.train_pattern, "--precision", "fp32",
        "--batch-size", "32", "--workers", "1", "--epochs", "1", "--lr", "2e-3", "--warmup", "5",
        "--log-every-n-steps", "4", "--logs", str(logs), "--name", name, *extra,
    ]  # fmt: skip


def train(args: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "bigclip.train", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def remote_objects(s3: LoopbackS3, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", [])]  # fmt: skip
    return {k[len(prefix) :]: client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


def remote_commits(s3: LoopbackS3, prefix: str) -> list[int]:
    listing = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}checkpoints/").get("Contents", [])
    return sorted(
        int(o["Key"].split("/step_")[1][:8]) for o in listing if o["Key"].endswith("/manifest.json")
    )


@pytest.mark.dist
@pytest.mark.slow
def test_spot_instance_pattern_resumes_exactly_from_the_remote_copy(demo_data, tmp_path, s3):
    """Train with a local checkpoint folder and --remote-sync; kill it; lose the local disk;
    rerun the same command: it resumes from S3 at the exact step, bitwise as a run that never
    stopped, and the first attempt's remote logs are intact."""
    remote = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/runs"
    flags = ("--max-steps", "24", "--save-every-n-steps", "8", "--save-frequency", "0", "--resume", "latest")
    reference = train(argv(demo_data, tmp_path / "ref", "ref", *flags))
    assert reference.returncode == 0, reference.stderr[-3000:]

    backup = ("--remote-sync", remote, "--remote-sync-frequency", "1", "--keep-last", "1")
    job = argv(demo_data, tmp_path / "logs", "spot", *flags, *backup)
    prefix = f"{remote.removeprefix(f's3://{BUCKET}/')}/spot/"
    first = subprocess.Popen([sys.executable, "-m", "bigclip.train", *job], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    deadline = time.monotonic() + 300
    while not remote_commits(s3, prefix) and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.1)
    assert first.poll() is None, "the run ended before it could be interrupted"
    first.send_signal(signal.SIGKILL)  # a spot instance vanishes: no handler runs
    first.wait(30)
    stopped_at = max(remote_commits(s3, prefix))
    assert stopped_at in (8, 16)
    logs_of_first = {k: v for k, v in remote_objects(s3, prefix).items() if not k.startswith("checkpoints/")}
    assert "out.log" in logs_of_first and "config.yaml" in logs_of_first

    shutil.rmtree(tmp_path / "logs")  # the local disk is gone
    second = train(job)
    assert second.returncode == 0, second.stderr[-3000:]
    out = (tmp_path / "logs" / "spot" / "out.log").read_text()
    assert f"--resume latest: remote copy {remote}/spot/checkpoints/step_{stopped_at:08d}" in out
    assert f"resumed {remote}/spot/checkpoints/step_{stopped_at:08d} at step {stopped_at}" in out
    assert "no committed checkpoint" not in out
    after = remote_objects(s3, prefix)
    assert all(after[k] == v for k, v in logs_of_first.items())  # nothing of the first attempt overwritten
    assert any(k.startswith("out.attempt-") for k in after)  # the second attempt's log beside it
    assert remote_commits(s3, prefix) == [8, 16, 24]  # the remote keeps all
    local = [
        p.name for p in (tmp_path / "logs" / "spot" / "checkpoints").iterdir() if p.name.startswith("step_")
    ]
    assert local == ["step_00000024"]  # --keep-last 1 pruned the others once they were backed up

    want = whole_checkpoint(tmp_path / "ref" / "ref" / "checkpoints" / "step_00000024")
    got = whole_checkpoint(tmp_path / "logs" / "spot" / "checkpoints" / "step_00000024")
    assert set(got) == set(want)
    for key, value in want.items():
        if key != "train.config":  # holds the run's name
            assert _equal(got[key], value), key  # weights, Adam moments, step, data position, RNG


def _equal(a: object, b: object) -> bool:
    import torch

    return torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b


@pytest.mark.dist
def test_a_wrong_remote_sync_bucket_stops_every_rank_before_the_model_is_built(demo_data, tmp_path, s3):
    job = argv(
        demo_data, tmp_path, "wrong", "--max-steps", "4", "--remote-sync", "s3://no-such-bucket-x/runs"
    )
    started = time.monotonic()
    procs = srun_like(job, 2, tmp_path)
    assert wait_all(procs, timeout_s=120) == [2, 2]
    assert time.monotonic() - started < 120
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.log").read_text()
        errors = [line for line in text.splitlines() if line.startswith("bigclip: error:")]
        assert len(errors) == 1 and "--remote-sync target s3://no-such-bucket-x/runs/wrong" in errors[0]
        assert "NoSuchBucket" in errors[0]
        assert "Train Epoch" not in text and "AWS_ERROR" not in text and "Traceback" not in text


@pytest.mark.dist
def test_a_final_sync_that_fails_makes_the_run_exit_non_zero_with_one_line(demo_data, tmp_path, s3):
    with FaultProxy(upstream=s3.endpoint) as proxy:
        proxy.add_rule("slowdown", method="PUT", path_contains="checkpoints/step_", times=-1)
        job = argv(demo_data, tmp_path, "unsynced", "--max-steps", "4", "--save-every-n-steps", "4",
                   "--remote-sync", f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", "--s3-endpoint", proxy.endpoint)  # fmt: skip
        done = train(job)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("bigclip: error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    assert "incomplete: checkpoint step_00000004 was not backed up" in errors[0] and "SlowDown" in errors[0]
    assert "Traceback" not in done.stderr


@pytest.mark.dist
def test_reusing_a_name_is_refused_unless_resuming_or_overwriting(demo_data, tmp_path, s3):
    remote = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    job = argv(
        demo_data, tmp_path, "exp", "--max-steps", "2", "--save-every-n-steps", "2", "--remote-sync", remote
    )
    assert train(job).returncode == 0
    config = (tmp_path / "exp" / "config.yaml").read_bytes()
    refused = train([*job, "--lr", "1e-3"])
    assert refused.returncode == 2
    assert "experiment 'exp' exists" in refused.stderr and "--resume latest" in refused.stderr
    assert (tmp_path / "exp" / "config.yaml").read_bytes() == config  # the refused run changed nothing
    shutil.rmtree(tmp_path / "exp")  # only the remote copy is left: still refused
    assert "holds committed checkpoints (the newest at step 2)" in train(job).stderr
    overwritten = train([*job, "--overwrite-run"])
    assert overwritten.returncode == 0, overwritten.stderr[-2000:]
    assert "--overwrite-run: deleted the checkpoints under" in overwritten.stdout


@pytest.mark.dist
def test_resuming_a_run_that_ended_at_an_epoch_end_saves_nothing_over_it(demo_data, tmp_path):
    job = argv(
        demo_data,
        tmp_path,
        "ended",
        "--train-num-samples",
        "128",
        "--save-frequency",
        "1",
        "--resume",
        "latest",
    )
    assert train(job).returncode == 0
    manifest = tmp_path / "ended" / "checkpoints" / "step_00000004" / "manifest.json"
    before = (manifest.read_bytes(), manifest.stat().st_mtime_ns)
    again = train(job)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed" in again.stdout and "checkpoint step 4 ->" not in again.stdout
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == before


@pytest.mark.dist
def test_save_most_recent_keeps_only_the_newest_of_its_checkpoints_locally_and_remotely(
    demo_data, tmp_path, s3
):
    remote = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    job = argv(demo_data, tmp_path, "recent", "--train-num-samples", "64", "--epochs", "5", "--save-frequency", "2",
               "--save-most-recent", "--remote-sync", remote, "--remote-sync-frequency", "1")  # fmt: skip
    done = train(job)
    assert done.returncode == 0, done.stderr[-2000:]
    # Epoch ends at steps 2, 4, 6, 8, 10: --save-frequency 2 keeps 4 and 8; 10 is the final save;
    # 2 and 6 were saved only as the most recent and are gone once a newer one committed.
    local = sorted(
        p.name for p in (tmp_path / "recent" / "checkpoints").iterdir() if p.name.startswith("step_")
    )
    assert local == ["step_00000004", "step_00000008", "step_00000010"]
    prefix = f"{remote.removeprefix(f's3://{BUCKET}/')}/recent/"
    assert remote_commits(s3, prefix) == [4, 8, 10]


def test_logs_on_s3_and_a_non_positive_sync_period_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--logs ./logs --remote-sync s3://b/logs"):
        parse_train_args(["--logs", "s3://b/logs"])
    for period in ("0", "-5"):
        with pytest.raises(ConfigError, match="--remote-sync-frequency must be at least 1"):
            parse_train_args(["--remote-sync", "s3://b/runs", "--remote-sync-frequency", period])
    assert not list(tmp_path.iterdir())  # no folder named 's3:' was created
