"""The pipeline over S3 (a loopback moto server): streamed shards, prefix listing, ranged resume."""

import glob
import os

import pytest
import torch
from test_data_common import IMAGE_SIZE, TOKENIZER, data_config, write_dataset

from bigclip.data.eval import iter_eval_samples
from bigclip.data.loader import build_train_loader
from bigclip.data.shards import validate_shards
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.demo.shapes_data import write_demo_data
from bigclip.errors import DataError
from bigclip.storage.s3 import S3Settings, boto3_client
from bigclip.storage.s3_stream import S3ObjectStream

BUCKET = "bigclip-data-test"
SIZES = [9, 14, 6, 11]


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def shards(s3, module_tmp):
    """The same shards on disk and in the bucket: (local pattern, s3 pattern)."""
    root = str(module_tmp("local"))
    write_dataset(root, SIZES)
    client = s3.client()
    for path in glob.glob(f"{root}/*"):
        client.upload_file(path, BUCKET, f"train/{os.path.basename(path)}")
    return f"{root}/{{00000..00003}}.tar", f"s3://{BUCKET}/train/{{00000..00003}}.tar"


def loader_for(pattern, **kw):
    cfg = data_config(pattern, **kw)
    return build_train_loader(
        cfg, rank=0, world_size=1, seed=1, epoch=0, image_size=IMAGE_SIZE, tokenizer=TOKENIZER
    )


def batches(loader, steps=0):
    out = []
    for batch in loader:
        out.append(batch)
        if steps and loader.steps == steps:
            break
    return out


def count_requests(client, operation: str) -> list:
    """Record the headers of every `operation` request this (real) boto3 client sends."""
    sent = []
    client.meta.events.register(
        f"before-send.s3.{operation}", lambda request, **_: sent.append(request.headers)
    )
    return sent


def test_s3_stream_gives_the_same_batches_as_local(shards):
    local, remote = shards
    from_disk, from_s3 = batches(loader_for(local, workers=2)), batches(loader_for(remote, workers=2))
    assert [b.keys for b in from_s3] == [b.keys for b in from_disk] and len(from_s3) == sum(SIZES) // 4
    for a, b in zip(from_disk, from_s3):
        torch.testing.assert_close(a.images, b.images)
        torch.testing.assert_close(a.texts, b.texts)


def test_resume_mid_shard_uses_ranged_reads(shards, s3):
    _, remote = shards
    first = loader_for(remote, batch_size=3)
    seen = [k for b in batches(first, steps=3) for k in b.keys]
    position = first.state_dict()
    assert position["cursors"], "some shard should be part-read after 3 steps"
    gets = count_requests(boto3_client(S3Settings.resolve()), "GetObject")
    cfg = data_config(remote, batch_size=3)
    resumed = build_train_loader(
        cfg,
        rank=0,
        world_size=1,
        seed=1,
        epoch=0,
        image_size=IMAGE_SIZE,
        tokenizer=TOKENIZER,
        position=position,
    )
    seen += [k for b in batches(resumed) for k in b.keys]
    assert len(seen) == len(set(seen)) and len(seen) >= sum(SIZES) - 3
    ranges = [
        h["Range"].decode() if isinstance(h["Range"], bytes) else h["Range"] for h in gets if "Range" in h
    ]
    starts = sorted(int(r.removeprefix("bytes=").rstrip("-")) for r in ranges)
    expected = sorted(byte for _, byte in position["cursors"].values())
    assert starts == expected  # part-read shards continue at their byte offset, not from byte 0


def test_validation_lists_the_prefix_instead_of_one_request_per_shard(s3):
    client = s3.client()
    for i in range(300):
        client.put_object(Bucket=BUCKET, Key=f"many/{i:05d}.tar", Body=b"")
    sent = count_requests(boto3_client(S3Settings.resolve(), fast_fail=True), "*")
    found = validate_shards(f"s3://{BUCKET}/many/{{00000..00399}}.tar")
    assert len(found) == 300 and len(found.missing) == 100
    assert len(sent) <= 2  # one listing page + the sizes.json lookup


def test_s3_pattern_matching_nothing_or_missing_bucket_is_a_clear_error(s3):
    with pytest.raises(DataError, match="matches no shard.*S3 endpoint http://127.0.0.1"):
        validate_shards(f"s3://{BUCKET}/nothing-here/{{00000..41455}}.tar")
    with pytest.raises(DataError, match="cannot list s3://no-such-bucket-x/"):
        validate_shards("s3://no-such-bucket-x/train/{00000..00009}.tar")


def test_s3_stream_reopens_after_a_dropped_connection(s3):
    data = bytes(range(256)) * 4096
    s3.client().put_object(Bucket=BUCKET, Key="blob.bin", Body=data)
    stream = S3ObjectStream(f"s3://{BUCKET}/blob.bin", client=boto3_client(S3Settings.resolve()))
    head = stream.read(100_000)
    stream._body._raw_stream.close()  # the connection drops mid-object
    assert head + stream.readall() == data


def test_demo_data_written_straight_to_s3_is_readable(s3):
    demo = write_demo_data(f"s3://{BUCKET}/demo", samples=12, shards=2, val_samples=6, image_size=16)
    assert validate_shards(demo.train_pattern).total_samples == 12
    held_out = list(iter_eval_samples(demo.val_pattern, image_size=16, tokenizer=TOKENIZER))
    assert len({s.caption for s in held_out}) == 6
