"""Objects that must never be replaced are refused by the S3 server itself, not by a prior check.

Immutable published names, leases and `--overwrite`-less outputs rest on S3's conditional write
(`If-None-Match: *` on PutObject and CompleteMultipartUpload). A client or a loopback server
that drops the condition would let a second writer replace the first one's object silently; a
check made before writing cannot catch a writer that arrives after it. So each test lets the
competing object appear after bigclip's own checks and asserts that the first writer's bytes
survive. This is what pins the declared lower bounds: boto3 1.35.2 is the first release that
sends `IfNoneMatch` (1.35.1 refuses the parameter), and moto 5.0.23 the first server that honours
it on both calls (5.0.14 accepts and ignores it on PutObject; 5.0.22 on multipart uploads). The
bound is 5.0.24: 5.0.23 never replaces an object that a multipart upload wrote (getmoto/moto#8417),
and every s3torchconnector PUT is one, so overwrites in the checkpoint tests silently did nothing.
"""

from __future__ import annotations

import uuid

import pytest

from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.errors import StorageError
from bigclip.storage import s3_sink
from bigclip.storage.locations import open_location

MIB = 1 << 20


@pytest.fixture(scope="module")
def s3():
    with LoopbackS3() as server:
        server.create_bucket("exclusive-tests")
        yield server


@pytest.fixture
def location(s3):
    return open_location(f"s3://exclusive-tests/{uuid.uuid4().hex[:8]}")


def read(s3: LoopbackS3, location, relative: str) -> bytes:
    bucket, _, prefix = location.uri[len("s3://") :].partition("/")
    return s3.client().get_object(Bucket=bucket, Key=f"{prefix}/{relative}")["Body"].read()


def test_create_exclusive_refuses_an_existing_object_and_keeps_the_first(s3, location):
    assert location.create_exclusive("leases/run-a", b"first") is True
    assert location.create_exclusive("leases/run-a", b"second") is False
    assert read(s3, location, "leases/run-a") == b"first"


@pytest.mark.parametrize("size", [1000, 5 * MIB + 10], ids=["one-put", "multipart"])
def test_a_sink_refuses_an_object_that_appeared_while_it_was_written(s3, location, monkeypatch, size):
    monkeypatch.setattr(s3_sink, "PART_BYTES", 5 * MIB)  # S3's smallest part: a multipart upload at 5 MiB
    sink = location.open_sink("model.safetensors", overwrite=False)  # nothing there yet: accepted
    sink.write(b"x" * size)
    assert location.create_exclusive("model.safetensors", b"the other writer's") is True
    with pytest.raises(StorageError, match="appeared while it was written; nothing was replaced"):
        sink.commit()
    assert read(s3, location, "model.safetensors") == b"the other writer's"


def test_overwrite_replaces(s3, location):
    assert location.create_exclusive("out.bin", b"old") is True
    sink = location.open_sink("out.bin", overwrite=True)
    sink.write(b"new")
    sink.commit()
    assert read(s3, location, "out.bin") == b"new"
