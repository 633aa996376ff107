"""Checkpoints on S3 keep each rank's objects under a prefix of its own, `step_N/<hex>/__R_0.distcp`,
and everything that reads, checks, copies or deletes a checkpoint follows them there.

Two real ranks save to the loopback S3 through a counting proxy; the checkpoint then loads in one
process (bigclip's verified reader), with stock DCP and s3torchconnector's own reader (no bigclip
code), as weights (`--pretrained`, consolidation) and from a registry publication; copied to a
local disk with its sub-folders it loads there and mirrors to another S3 root. A checkpoint of the
flat layout (every save before the prefixes) still loads. Deleting a checkpoint costs one LIST
page and one DeleteObjects request per 1,000 objects.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3torchconnector import S3ClientConfig
from s3torchconnector.dcp import S3StorageReader
from support.s3_fault_proxy import FaultProxy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from bigclip.checkpoint import CheckpointStore
from bigclip.checkpoint.mirror import CheckpointMirror
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn
from bigclip.registry.registry import Registry
from bigclip.storage import rank_prefixes
from bigclip.storage.locations import LocalLocation, open_location
from bigclip.storage.s3_dcp_writer import S3CheckpointWriter
from bigclip.storage.settings import configure_storage, storage_configured
from bigclip.weights.sources import open_weights

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
BUCKET = "layout-tests"
WORLD = 2


def whole_state(world: int = WORLD) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(48, 32, generator=g) for i in range(2)}, "train": {"step": 3}}


def rank_state(rank: int, world: int) -> dict:
    """Each tensor sharded by rows over the ranks, as the engines' are: each rank writes its rows."""
    mesh = init_device_mesh("cpu", (world,))
    state = whole_state()
    state["model"] = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in state["model"].items()}
    return state


def zeros_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "train": {"step": 0}}


def assert_loaded(got: dict, want: dict) -> None:
    assert got["train"] == want["train"]
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())


def _save(rank: int, world: int, root: str, endpoint: str) -> str:
    configure_storage(s3_endpoint=endpoint)
    store = CheckpointStore(root)
    store.save(rank_state(rank, world), step=3)
    prefix = store.location.dcp_writer("step_00000003", world_size=world)[0].prefix_strategy(rank)
    store.close()
    return prefix


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.mark.dist
def test_ranks_write_under_their_own_prefixes_and_every_reader_follows(s3, tmp_path):
    root = f"s3://{BUCKET}/prefixed/checkpoints"
    with FaultProxy(upstream=s3.endpoint) as proxy:
        prefixes = spawn(_save, WORLD, root, proxy.endpoint)
    assert len({p.split("/")[0] for p in prefixes}) == WORLD  # "<hex>/__R_": a sub-folder per rank
    store = CheckpointStore(root)
    names = [f"{p}{n}" for p in prefixes for n in ("0.distcp", "rank.bigclip")]  # its shard, its record
    assert sorted(store.location.list_files("step_00000003")) == sorted(
        [".metadata", "manifest.json", *names]
    )
    assert set(store.verify().objects) == {".metadata", *names}  # every byte re-read, every hash equal
    target = zeros_like(whole_state())
    store.load(target)
    assert_loaded(target, whole_state())

    # Stock DCP with s3torchconnector's own reader: the paths are in .metadata, relative to the folder.
    stock = zeros_like(whole_state())
    reader = S3StorageReader(
        "us-east-1", f"{root}/step_00000003", s3client_config=S3ClientConfig(force_path_style=True)
    )
    dcp.load(stock, storage_reader=reader, no_dist=True)
    assert_loaded(stock, whole_state())

    # As weights (--pretrained, `bigclip consolidate`) and from a registry publication.
    source = open_weights(f"{root}/step_00000003")
    assert torch.equal(source.reader.read("model.w1"), whole_state()["model"]["w1"])
    registry = Registry(f"s3://{BUCKET}/registry")
    assert set(registry.publish(f"{root}/step_00000003", "prefixed").objects) >= set(names)
    published = open_weights("registry:prefixed", registry=registry.uri)
    assert torch.equal(published.reader.read("model.w0"), whole_state()["model"]["w0"])

    # Copied to a local disk whole (aws s3 cp --recursive): it loads there, and mirrors back out.
    local = tmp_path / "copy"
    for name in store.location.list_files(""):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(store.location.read_bytes(name))
    assert LocalLocation(local).list_files("step_00000003") == store.location.list_files("step_00000003")
    copied = zeros_like(whole_state())
    CheckpointStore(str(local)).load(copied)
    assert_loaded(copied, whole_state())
    remote = open_location(f"s3://{BUCKET}/mirrored", fork_safe=True)
    assert [r.step for r in CheckpointMirror(LocalLocation(local), remote).sync()] == [3]
    mirrored = zeros_like(whole_state())
    CheckpointStore(f"s3://{BUCKET}/mirrored").load(mirrored)
    assert_loaded(mirrored, whole_state())


def test_a_checkpoint_of_the_flat_layout_still_loads(s3, tmp_path):
    """Saved before the prefixes (as every local checkpoint still is): `step_N/__0_0.distcp`."""
    flat = CheckpointStore(
        str(tmp_path / "flat"), io_threads=1
    )  # torch 2.11 writes empty files for idle threads
    flat.save(whole_state(1), step=3)
    client = s3.client()
    for path in (tmp_path / "flat" / "step_00000003").iterdir():
        client.upload_file(str(path), BUCKET, f"flat/step_00000003/{path.name}")
    store = CheckpointStore(f"s3://{BUCKET}/flat")
    assert "__0_0.distcp" in store.verify().objects
    target = zeros_like(whole_state(1))
    store.load(target)
    assert_loaded(target, whole_state(1))


def test_readers_name_each_ranks_objects_as_the_writer_does() -> None:
    """A checkpoint's manifest records its prefix rule; readers rebuild every rank's prefix from it."""
    for world in (1, 7, 16, 17, 1024, 70_000):
        writer = S3CheckpointWriter("us-east-1", f"s3://{BUCKET}/x", world_size=world)
        assert writer.prefix_rule == rank_prefixes.HEX
        for rank in {0, 1, world // 2, world - 1}:
            assert rank_prefixes.prefix(writer.prefix_rule, rank, world) == writer.prefix_strategy(rank)


def test_deleting_a_folder_takes_a_request_per_thousand_objects(s3):
    objects = 1001  # just over S3's 1,000 keys: two LIST pages, two DeleteObjects requests, no DELETE
    client = s3.client()
    keys = [f"big/step_00000001/{i % 7:04x}/__{i}_0.distcp" for i in range(objects)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=BUCKET, Key=k, Body=b"x"), keys))
    with FaultProxy(upstream=s3.endpoint) as proxy, storage_configured(s3_endpoint=proxy.endpoint):
        location = open_location(f"s3://{BUCKET}/big")
        assert len(location.list_files("step_00000001")) == objects
        proxy.requests.clear()
        location.delete_folder("step_00000001")
        methods = [(m, "?delete" in path) for m, path in proxy.requests]
        assert methods.count(("POST", True)) == math.ceil(objects / 1000)
        assert methods.count(("GET", False)) == math.ceil(objects / 1000)  # the listing's pages
        assert len(methods) == 2 * math.ceil(objects / 1000)
        assert location.list_files("step_00000001") == {}


def test_a_local_listing_is_recursive_like_an_object_stores(tmp_path):
    folder = Path(tmp_path, "step_00000001")
    (folder / "ab12").mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"12")
    (folder / "ab12" / "__0_0.distcp").write_bytes(b"123")
    assert LocalLocation(tmp_path).list_files("step_00000001") == {".metadata": 2, "ab12/__0_0.distcp": 3}
