"""Faults during a save: a rank killed mid-save, S3 throttling and dropped connections.

Whatever happens, the newest *committed* checkpoint stays the one `latest()` and `load()`
use, and a save either commits or raises a StorageError that says what went wrong.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import uuid
from pathlib import Path

import pytest
import torch
from support.s3_fault_proxy import FaultProxy

from bigclip.checkpoint import CheckpointStore
from bigclip.checkpoint.manifest import MANIFEST_NAME
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.errors import StorageError
from bigclip.storage.settings import configure_storage, storage_configured

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    # DCP's helper writer threads die with the injected S3 errors; the store reports them.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
]


def make_state(step: int, rank: int = 0) -> dict:
    g = torch.Generator().manual_seed(step)
    weights = {f"layer{i}": torch.randn(64, 32, generator=g) for i in range(8)}
    return {"model": weights, "train": {"step": step}}


class KillsItsProcessWhenPickled:
    """Placed in a rank's state: DCP pickles it while that rank writes its shard file."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def _save_then_die_mid_save(rank: int, world: int, root: str) -> None:
    store = CheckpointStore(root)
    store.save(make_state(1), step=1)
    state = make_state(2)
    if rank == 1:
        state["train"]["rank1_only"] = KillsItsProcessWhenPickled()
    store.save(state, step=2)


def _save_then_hang_in_upload(rank: int, world: int, root: str, endpoint: str, pid_dir: str) -> None:
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    configure_storage(s3_endpoint=endpoint)  # as --s3-endpoint does
    store = CheckpointStore(root)
    store.save(make_state(1), step=1)
    store.save(make_state(2), step=2)  # the proxy holds rank 1's upload until the rank is killed


def assert_resumes_from_step_1(store: CheckpointStore) -> None:
    assert store.latest() == store.location.child_uri("step_00000001")
    target = make_state(0)
    assert store.load(target, "latest").step == 1
    assert all(torch.equal(target["model"][k], v) for k, v in make_state(1)["model"].items())
    # (on S3 a save that failed leaves nothing; on a disk, files without a manifest)
    with pytest.raises(
        StorageError, match=r"(not a committed checkpoint|nothing is there).*Committed ones .*step_00000001"
    ):
        store.load(make_state(0), store.location.child_uri("step_00000002"))


@pytest.mark.dist
def test_rank_killed_mid_save_leaves_the_previous_checkpoint_latest(tmp_path):
    root = str(tmp_path / "ckpt")
    # Whichever is seen first: rank 1's death, or rank 0's save failing as its peer vanished.
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9|not committed"):
        spawn(_save_then_die_mid_save, 2, root, timeout_s=300)
    store = CheckpointStore(root)
    assert store.location.list_files("step_00000002")  # the interrupted save left files behind
    assert_resumes_from_step_1(store)


@pytest.mark.dist
def test_rank_killed_during_s3_upload_leaves_the_previous_checkpoint_latest(tmp_path):
    with LoopbackS3() as s3, FaultProxy(upstream=s3.endpoint) as proxy:
        root = s3.create_bucket("killed") + "/run/ckpt"
        # Rank 1 of 2 writes under its own prefix (where its writer's prefix strategy says).
        prefix = (
            CheckpointStore(root).location.dcp_writer("step_00000002", world_size=2)[0].prefix_strategy(1)
        )
        proxy.add_rule("stall", method="PUT", path_contains=f"step_00000002/{prefix}0.distcp")
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                spawn(_save_then_hang_in_upload, 2, root, proxy.endpoint, str(tmp_path), timeout_s=300)
            except BaseException as e:
                outcome.append(e)

        runner = threading.Thread(target=run)
        runner.start()
        assert proxy.stalled.wait(timeout=240), "rank 1 never started uploading step 2"
        os.kill(int((tmp_path / "rank1").read_text()), signal.SIGKILL)
        runner.join(timeout=120)
        proxy.release()
        assert outcome and re.search("rank 1 exited with code -9|not committed", str(outcome[0]))
        assert_resumes_from_step_1(CheckpointStore(root))


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket("faults")
        yield server


@pytest.fixture
def proxy(s3):
    """The proxy is the S3 endpoint for the whole test (as --s3-endpoint would make it)."""
    with FaultProxy(upstream=s3.endpoint) as p, storage_configured(s3_endpoint=p.endpoint):
        yield p


def store_via(proxy: FaultProxy, **options) -> CheckpointStore:
    return CheckpointStore(f"s3://faults/{uuid.uuid4().hex[:8]}", max_attempts=3, **options)


def test_transient_throttling_and_dropped_connections_are_retried(proxy):
    store = store_via(proxy)
    proxy.add_rule("slowdown", method="PUT", path_contains=".distcp", times=3)
    proxy.add_rule("drop", method="PUT", path_contains=".distcp", times=2)
    store.save(make_state(1), step=1)
    assert proxy.injected["slowdown"] == 3 and proxy.injected["drop"] == 2
    target = make_state(0)
    assert store.load(target, "latest").step == 1
    assert all(torch.equal(target["model"][k], v) for k, v in make_state(1)["model"].items())
    store.verify("latest")


def test_an_object_throttled_past_the_clients_tries_is_written_again(proxy):
    store = store_via(proxy)  # three tries per request
    proxy.add_rule("slowdown", method="PUT", path_contains=".distcp", times=3)  # every try of the one part
    store.save(make_state(1), step=1)  # the writer writes the object again, after a backoff
    assert proxy.injected["slowdown"] == 3
    assert store.verify("latest").step == 1  # whole: what the manifest records is what is stored
    target = make_state(0)
    store.load(target, "latest")
    assert all(torch.equal(target["model"][k], v) for k, v in make_state(1)["model"].items())


@pytest.mark.timeout(120)  # three attempts per request (and the writer's rewrites), then a clear error
@pytest.mark.parametrize(
    ("action", "explanation"),
    [("slowdown", "kept throttling"), ("drop", "connection to S3 kept failing")],
)
def test_persistent_s3_faults_fail_clearly_and_commit_nothing(proxy, action, explanation):
    store = store_via(proxy)
    store.save(make_state(1), step=1)
    proxy.add_rule(action, method="PUT", path_contains="step_00000002/", times=-1)
    with pytest.raises(StorageError, match=f"{explanation}.*not committed"):
        store.save(make_state(2), step=2)
    proxy.clear_rules()
    assert_resumes_from_step_1(store)


def test_a_write_lost_in_a_writer_thread_fails_the_commit(proxy):
    # A rank's other objects are written by other threads (DCP's own die silently; the S3
    # writer's raise): the commit fails either way, after the writer's rewrites of throttled ones.
    store = store_via(proxy, io_threads=4)
    store.save(make_state(1), step=1)
    for name in ("__0_1.distcp", "__0_2.distcp", "__0_3.distcp"):
        proxy.add_rule("slowdown", method="PUT", path_contains=f"step_00000002/0000/{name}", times=-1)
    with pytest.raises(StorageError, match="not committed"):
        store.save(make_state(2), step=2)
    proxy.clear_rules()
    assert not store.location.exists(f"step_00000002/{MANIFEST_NAME}")
    assert_resumes_from_step_1(store)


def test_failing_to_write_the_manifest_leaves_the_save_uncommitted(proxy):
    store = store_via(proxy)
    store.save(make_state(1), step=1)
    proxy.add_rule("slowdown", method="PUT", path_contains=f"step_00000002/{MANIFEST_NAME}", times=-1)
    with pytest.raises(StorageError, match="was not committed"):
        store.save(make_state(2), step=2)
    proxy.clear_rules()
    assert_resumes_from_step_1(store)
