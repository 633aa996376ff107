"""`bigclip index-shards`: sizes.json equal to what the reader yields, local and on S3, damage included."""

import glob
import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest
from test_data_common import bad_sample, good_sample, write_dataset, write_shard

from bigclip.cli import main as cli_main
from bigclip.data.index import count_samples, index_shards, write_sizes
from bigclip.data.shards import validate_shards
from bigclip.data.tar_samples import ShardSamples
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.demo.shapes_data import tar_bytes

SIZES = [9, 14, 6, 11]


def true_count(url: str) -> int:
    return sum(1 for _ in ShardSamples(url))


@pytest.fixture()
def damaged(tmp_path):
    """Shards: whole, one with a corrupt member, one with metadata, one cut mid-member, one with a bad header."""
    import random

    rng = random.Random(0)
    root = str(tmp_path)
    samples = [good_sample(f"k{i:03d}", rng) for i in range(10)]
    write_shard(f"{root}/0.tar", samples)
    write_shard(f"{root}/1.tar", samples[:4] + [bad_sample("k100")] + samples[4:])  # undecodable image
    meta = [{"__key__": "__meta__", "json": b"{}"}] + samples[:5]
    write_shard(f"{root}/2.tar", meta)
    whole = tar_bytes(samples)
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        members = tar.getmembers()
    with open(f"{root}/3.tar", "wb") as f:
        f.write(whole[: members[11].offset_data + 5])  # cut inside the data of sample 5's second member
    garbled = bytearray(whole)
    garbled[512 * 12 : 512 * 12 + 100] = b"\x07" * 100  # a header in the middle overwritten
    with open(f"{root}/4.tar", "wb") as f:
        f.write(garbled)
    return root


def test_counts_equal_what_the_reader_yields_damage_included(damaged):
    urls = [f"{damaged}/{i}.tar" for i in range(5)]
    counts = [count_samples(u) for u in urls]
    assert [c.samples for c in counts] == [true_count(u) for u in urls]
    assert [c.samples for c in counts][:3] == [10, 11, 5]  # a corrupt image is still a sample
    assert [bool(c.error) for c in counts] == [False, False, False, True, True]
    assert counts[3].samples == 5 and "cut short" in counts[3].error
    assert 0 < counts[4].samples < 10 and "header" in counts[4].error


def test_cli_writes_sizes_json_that_training_reads(tmp_path, capsys):
    pattern = write_dataset(str(tmp_path), SIZES, compressed=(2,))
    os.remove(tmp_path / "sizes.json")
    with open(tmp_path / "sizes.json", "w") as f:
        json.dump({"other.tar": 7}, f)  # entries for shards of other patterns are kept
    assert cli_main(["index-shards", pattern, "--threads", "3", "--no-progress"]) == 0
    sizes = json.loads((tmp_path / "sizes.json").read_text())
    assert sizes == {"00000.tar": 9, "00001.tar": 14, "00002.tgz": 6, "00003.tar": 11, "other.tar": 7}
    assert validate_shards(pattern).total_samples == sum(SIZES)
    assert "40 samples in 4 shards (0 damaged)" in capsys.readouterr().out


def test_damaged_shards_keep_their_listed_counts_and_fail_the_command(damaged, capsys):
    """A shard index-shards cannot read to the end (damaged, or xz-compressed) keeps the count
    sizes.json had for it (a damaged copy must not zero a good count), one not listed gets its count
    up to the damage, and the command fails in one line: a script that indexes then trains stops."""
    with open(f"{damaged}/sizes.json", "w") as f:
        json.dump({"3.tar": 10}, f)  # counted before 3.tar was cut short
    assert cli_main(["index-shards", f"{damaged}/{{0..4}}.tar", "--no-progress"]) == 2
    out = capsys.readouterr()
    assert re.search(r"error: 2 of 5 shards could not be read to the end, e\.g\. .*3\.tar", out.err), out.err
    assert "(2 damaged)" in out.out
    sizes = json.loads(Path(damaged, "sizes.json").read_text())
    assert sizes["3.tar"] == 10 and sizes["4.tar"] == count_samples(f"{damaged}/4.tar").samples
    assert [sizes[f"{i}.tar"] for i in range(3)] == [10, 11, 5]


def test_s3_shards_are_indexed_in_place(tmp_path):
    root = str(tmp_path)
    write_dataset(root, SIZES)
    with LoopbackS3() as server:
        server.create_bucket("index-test")
        client = server.client()
        for path in glob.glob(f"{root}/*.tar"):
            client.upload_file(path, "index-test", f"train/{os.path.basename(path)}")
        pattern = "s3://index-test/train/{00000..00003}.tar"
        counts = index_shards(pattern, threads=4, progress=False)
        assert [c.samples for c in counts] == SIZES
        assert write_sizes(counts) == ["s3://index-test/train/sizes.json"]
        assert validate_shards(pattern).sizes == tuple(SIZES)


@pytest.mark.parametrize("kind, compress", [("gzip", "gzip"), ("xz", "lzma")])
def test_a_shard_compressed_under_a_tar_name_is_said_to_be(tmp_path, kind, compress):
    """A .tar that is really gzip'd or xz'd is not a damaged tar: the reader's reason says what it is."""
    import importlib

    path = tmp_path / "00000.tar"
    write_shard(str(path), [{"__key__": "k0", "txt": b"a caption"}])
    path.write_bytes(importlib.import_module(compress).compress(path.read_bytes()))
    reader = ShardSamples(str(path))
    assert list(reader) == [] and f"(the file is {kind}-compressed; bigclip reads .tar shards" in reader.error
