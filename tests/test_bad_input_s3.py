"""S3 endpoints that cannot be used: one that refuses connections, a bucket that does not exist or
was deleted, credentials the endpoint rejects, no credentials at all. Each fails with one line that
names the endpoint or bucket and what to fix, through `bigclip doctor`, `bigclip index-shards` and
`bigclip train` (data and checkpoints on S3), and leaves the local shards and run as they were.

Endpoints are moto servers on 127.0.0.1: the loopback one (bigclip.demo.loopback_s3) and, for
rejected credentials, a `moto_server` started with INITIAL_NO_AUTH_ACTION_COUNT=0 so it checks keys.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from support.bad_input import TORCH_FIRST_S, Case, bigclip, check, run
from support.s3_fault_proxy import FaultProxy

from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.demo.shapes_data import write_demo_data
from bigclip.distributed import free_port
from bigclip.train.signals import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.dist  # `bigclip train` rows form a (one-rank) process group before S3 is tried

# Training rows get as far as the process group (torch, the data and checkpoint code imported):
# 3-5 s on an idle 2-core box; the S3 checks answer in well under a second after that.
TRAIN_S = 15.0
# A run whose endpoint goes away mid-read: its start, then the client's tries; bounds the wall time (x6).
LOST_S = 40.0
# Two tries per request where an endpoint goes away mid-run: the verdict after the last try is the
# same as after the default ten, without ten back-offs of waiting (~2 minutes).
FEW_TRIES = {"AWS_MAX_ATTEMPTS": "2"}
LOCAL = "data/train/{00000..00001}.tar"
TRAIN = ("--model", "tiny", "--logs", "logs", "--name", "fresh", "--batch-size", "4", "--workers", "0")
NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_PROFILE": None,
                  "AWS_SESSION_TOKEN": None, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                  "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip


def cases(ok: dict[str, str], dead: dict[str, str], strict: dict[str, str]) -> list[Case]:
    """`ok`: the loopback endpoint's environment; `dead`: nothing listens there; `strict`: keys checked."""
    s3_data = "s3://bi-data/train/{00000..00001}.tar"
    return [
        Case("doctor-refused", bigclip("doctor", "s3://bi-ckpt/runs", "--size-mb", "0"),
             ("s3://bi-ckpt/runs", "cannot connect to the endpoint", "--s3-endpoint"), code=1, env=dead,
             max_s=TORCH_FIRST_S),
        Case("doctor-wrong-bucket", bigclip("doctor", "s3://no-such-bucket/runs", "--size-mb", "0"),
             ("s3://no-such-bucket/runs: list", "the bucket does not exist", "check the bucket name"), code=1,
             env=ok, max_s=TORCH_FIRST_S),
        Case("doctor-deleted-bucket", bigclip("doctor", "s3://bi-gone/runs", "--size-mb", "0"),
             ("s3://bi-gone/runs: list", "the bucket does not exist"), code=1, env=ok, max_s=TORCH_FIRST_S),
        Case("doctor-rejected-keys", bigclip("doctor", "s3://bi-ckpt/runs", "--size-mb", "0"),
             ("s3://bi-ckpt/runs", "the access key is not valid for this endpoint"), code=1, env=strict,
             max_s=TORCH_FIRST_S),
        Case("doctor-no-credentials", bigclip("doctor", "s3://bi-ckpt/runs", "--size-mb", "0"),
             ("credentials", "no AWS credentials found", "AWS_ACCESS_KEY_ID"), code=1, env={**ok, **NO_CREDENTIALS},
             max_s=TORCH_FIRST_S),
        Case("doctor-unknown-profile", bigclip("doctor", "s3://bi-ckpt/runs", "--size-mb", "0"),
             ("credentials", "fix or unset AWS_PROFILE"), code=1, env={**ok, **NO_CREDENTIALS, "AWS_PROFILE": "nope"},
             max_s=TORCH_FIRST_S),
        Case("index-refused", bigclip("index-shards", s3_data), ("s3://bi-data/train/", "AWS_ENDPOINT_URL"),
             env=dead),  # index-shards imports no torch: the suite's default bound
        Case("index-wrong-bucket", bigclip("index-shards", "s3://no-such-bucket/train/{00000..00001}.tar"),
             ("no-such-bucket",), env=ok),
        Case("train-data-refused", bigclip("train", *TRAIN, "--train-data", s3_data),
             ("cannot list s3://bi-data/train/", "AWS_ENDPOINT_URL"), env=dead, max_s=TRAIN_S),
        Case("train-data-wrong-bucket", bigclip("train", *TRAIN, "--train-data", "s3://no-such-bucket/{0..1}.tar"),
             ("no-such-bucket",), env=ok, max_s=TRAIN_S),
        Case("train-data-rejected-keys", bigclip("train", *TRAIN, "--train-data", s3_data),
             ("s3://bi-data/train/",), env=strict, max_s=TRAIN_S),
        Case("checkpoints-refused", bigclip("train", *TRAIN, "--train-data", LOCAL, "--checkpoint-dir",
                                            "s3://bi-ckpt/run"),
             ("s3://bi-ckpt/run is not usable", "cannot connect to the endpoint"), env=dead, max_s=TRAIN_S),
        Case("checkpoints-wrong-bucket", bigclip("train", *TRAIN, "--train-data", LOCAL, "--checkpoint-dir",
                                                 "s3://no-such-bucket/run"),
             ("s3://no-such-bucket/run is not usable", "the bucket does not exist"), env=ok, max_s=TRAIN_S),
        Case("checkpoints-deleted-bucket-resume", bigclip("train", *TRAIN, "--train-data", LOCAL, "--resume", "latest",
                                                          "--checkpoint-dir", "s3://bi-gone/run"),
             ("s3://bi-gone/run is not usable", "the bucket does not exist"), env=ok, max_s=TRAIN_S),
        Case("checkpoints-rejected-keys", bigclip("train", *TRAIN, "--train-data", LOCAL, "--checkpoint-dir",
                                                  "s3://bi-ckpt/run"),
             ("s3://bi-ckpt/run is not usable", "the access key is not valid"), env=strict, max_s=TRAIN_S),
        Case("checkpoints-no-credentials", bigclip("train", *TRAIN, "--train-data", LOCAL, "--checkpoint-dir",
                                                   "s3://bi-ckpt/run"),
             ("s3://bi-ckpt/run is not usable", "no AWS credentials found"), env={**ok, **NO_CREDENTIALS},
             max_s=TRAIN_S),
        Case("checkpoints-bad-max-attempts", bigclip("train", *TRAIN, "--train-data", LOCAL, "--checkpoint-dir",
                                                     "s3://bi-ckpt/run"),
             ("AWS_MAX_ATTEMPTS='lots'", "a whole number of at least 1", "or unset it"),
             env={**ok, "AWS_MAX_ATTEMPTS": "lots"}, max_s=TRAIN_S),
        Case("remote-sync-wrong-bucket", bigclip("train", *TRAIN, "--train-data", LOCAL, "--remote-sync",
                                                 "s3://no-such-bucket/logs"),
             ("s3://no-such-bucket/logs", "the bucket does not exist"), env=ok, max_s=TRAIN_S),
    ]  # fmt: skip


NAMES = [c.name for c in cases({}, {}, {})]


@pytest.fixture(scope="module")
def strict_endpoint():
    """A moto server that checks access keys (none exist on it, so every key is rejected)."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    yield url
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def table(module_tmp, strict_endpoint) -> dict[str, tuple[Case, Path]]:
    home = module_tmp("s3")
    write_demo_data(
        str(home / "data"), samples=16, shards=2, val_samples=4, classify_samples=0, image_size=16
    )
    (home / "logs" / "exp").mkdir(parents=True)
    (home / "logs" / "exp" / "config.yaml").write_text("model: {model: tiny}\n")
    with LoopbackS3(set_environ=False) as s3:  # the test process keeps its own environment
        for bucket in ("bi-data", "bi-ckpt", "bi-gone"):
            s3.create_bucket(bucket)
        for shard in (home / "data" / "train").iterdir():  # the local shards, also in the bucket
            s3.client().upload_file(str(shard), "bi-data", f"train/{shard.name}")
        s3.client().delete_bucket(Bucket="bi-gone")  # existed, and is gone when the runs start
        dead = {**s3.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
        strict = {**s3.env, "AWS_ENDPOINT_URL": strict_endpoint}
        yield {c.name: (c, home) for c in cases(s3.env, dead, strict)}


@pytest.mark.parametrize("name", NAMES)
def test_unusable_s3_endpoint(name: str, table) -> None:
    case, home = table[name]
    check(case, cwd=home, protect=[home / "data", home / "logs" / "exp"])


@pytest.mark.slow  # a training start, then the data client's tries
def test_an_endpoint_lost_mid_run_is_said_unreachable_not_damaged(tmp_path: Path) -> None:
    """The endpoint answers the start (the listing, sizes.json) and goes away while the loader reads
    the first shard: before, the run ended with "damaged shards: 1 ... replace those shards"."""
    write_demo_data(
        str(tmp_path / "data"), samples=16, shards=1, val_samples=0, classify_samples=0, image_size=16
    )
    with LoopbackS3(set_environ=False) as s3, FaultProxy(upstream=s3.endpoint) as proxy:
        s3.create_bucket("bi-lost")
        for item in (tmp_path / "data" / "train").iterdir():
            s3.client().upload_file(str(item), "bi-lost", f"train/{item.name}")
        proxy.add_rule("stall", method="GET", path_contains=".tar", times=-1)  # the shard's first read

        def lose_the_endpoint() -> None:
            if proxy.stalled.wait(timeout=600):
                proxy.cut()  # the held read and every open connection reset, new ones refused

        threading.Thread(target=lose_the_endpoint, daemon=True).start()
        case = Case("endpoint lost mid-run", bigclip("train", *TRAIN, "--train-data", "s3://bi-lost/train/00000.tar"),
                    ("1 shard(s) could not be read", "not because they are damaged", "cannot connect to the endpoint",
                     "--resume latest"), env={**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint, **FEW_TRIES}, max_s=LOST_S,
                    leaves=("logs/fresh",))  # fmt: skip
        check(case, cwd=tmp_path, protect=[tmp_path / "data"])


@pytest.mark.slow  # a training start, then the checkpoint client's tries
def test_an_endpoint_lost_during_a_save_is_said_unreachable(tmp_path: Path) -> None:
    """The checkpoint bucket answers the start (the access check) and goes away during the first
    save: before, the line was the client's ("cannot read .../manifest.json: Client error ...")."""
    write_demo_data(
        str(tmp_path / "data"), samples=16, shards=1, val_samples=0, classify_samples=0, image_size=16
    )
    with LoopbackS3(set_environ=False) as s3, FaultProxy(upstream=s3.endpoint) as proxy:
        s3.create_bucket("bi-lost")
        proxy.add_rule("stall", method="PUT", path_contains=".distcp", times=-1)  # the first save's upload

        def lose_the_endpoint() -> None:
            if proxy.stalled.wait(timeout=600):
                proxy.cut()

        threading.Thread(target=lose_the_endpoint, daemon=True).start()
        case = Case("endpoint lost during a save", bigclip("train", *TRAIN, "--train-data", "data/train/00000.tar",
                    "--max-steps", "2", "--save-every-n-steps", "1", "--checkpoint-dir", "s3://bi-lost/run"),
                    (), env={**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint, **FEW_TRIES})  # fmt: skip
        out = run(case, cwd=tmp_path)
    # An outage passes: the periodic save warns, the final one fails and the run exits 85 to be
    # requeued (checkpoints.md, "When a save fails"), each line saying in words what went wrong.
    assert out.code == REQUEUE_EXIT_CODE and "Traceback" not in out.stdout + out.stderr, out.stdout[-3000:]
    failed = [line for line in out.stdout.splitlines() if "checkpoint step" in line and "failed" in line]
    assert [("step 1" in line, "step 2" in line) for line in failed] == [(True, False), (False, True)], failed
    # The held upload's socket is closed under it by the cut, so whether its last try saw the socket
    # closed or a refused reconnect is a race; either reading is the right one for the periodic save.
    unreachable = "cannot connect to the endpoint (refused or no answer: it is down"
    dropped = "the connection to S3 kept failing (dropped or reset)"
    assert unreachable in failed[0] or dropped in failed[0], failed
    assert "AWS_IO_" in failed[0], failed  # the client's own words kept, in brackets
    assert unreachable in failed[1], failed  # the final save opens new connections: refused
