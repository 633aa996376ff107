"""Bad training data: each fails with one line naming the shards (or sizes.json) and the fix.

Every row is a real `python -m bigclip train ...` or `bigclip index-shards ...` over shards a
fixture wrote (12 px images, keys sSSSSiIIII), and the data folders must stay byte for byte as
they were: index-shards --check writes nothing, a refused run touches no shard or sizes.json.

What sizes.json settles (a budget above the data, all shards empty, a malformed file) fails at
the start, before a model is built. What only reading can find (an empty tar or a damaged one
where sizes.json does not list them) fails when no rank can fill a batch, naming those shards;
where the rest of the data can still fill the epoch, the run goes on and the epoch's account
line counts and names them instead (tests/test_data_epoch_accounting.py).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from support.bad_input import Case, bigclip, check
from test_data_common import IMAGE_SIZE, TOKENIZER, data_config, good_sample, write_dataset

from bigclip.data.accounting import MORE_THAN_LISTED
from bigclip.data.loader import build_train_loader
from bigclip.demo.shapes_data import tar_bytes

# `bigclip train` imports torch before the data is checked (4-6 s on a busy 2-core box); `index-shards`
# imports none (it reads tar headers only), so its rows keep the suite's default bound.
STARTUP_S = 15.0
# Rows found only by reading: the tiny model is built and the loader starts before they fail.
READ_S = 90.0
BASE = ("--model", "tiny", "--precision", "fp32", "--batch-size", "8", "--workers", "0", "--epochs", "1",
        "--logs", "logs", "--name", "run")  # fmt: skip


def train(name: str, data: str, *flags: str, says: tuple[str, ...], max_s: float = STARTUP_S) -> Case:
    # A run found bad only by reading has started: its folder (the log saying what failed) stays.
    started = ("logs/run",) if max_s == READ_S else ()
    return Case(
        name, bigclip("train", "--train-data", data, *BASE, *flags), says, max_s=max_s, leaves=started
    )


def index(name: str, data: str, *flags: str, says: tuple[str, ...]) -> Case:
    return Case(name, bigclip("index-shards", data, "--no-progress", *flags), says)


CASES = [
    train("missing-shards", "data/none/{00000..00003}.tar", says=("matches no shard", "Check the path")),
    train("num-samples-above-data", "data/good/{00000..00004}.tar", "--train-num-samples", "301",
          says=("--train-num-samples 301 is more than the 300 samples", "lower it to at most 300")),
    train("all-shards-empty", "data/empty/{00000..00001}.tar",
          says=("sizes.json lists no sample", "point --train-data at shards with data")),
    train("sizes-json-not-an-object", "data/sizes_list/00000.tar",
          says=("sizes.json is not a JSON object", "bigclip index-shards")),
    train("sizes-json-negative-count", "data/sizes_negative/00000.tar",
          says=("lists -3 samples for 00000.tar, not a count", "bigclip index-shards")),
    train("empty-tar-unlisted", "data/empty_tar/00000.tar", "--train-num-samples", "16", max_s=READ_S,
          says=("not every rank could fill one batch", "empty shards: 1", "replace those shards")),
    train("damaged-tar-unlisted", "data/damaged/00000.tar", "--train-num-samples", "16", max_s=READ_S,
          says=("not every rank could fill one batch", "damaged shards: 1", "replace those shards")),
    index("index-missing-shards", "data/none/{00000..00003}.tar", says=("matches no shard",)),
    index("index-check-stale-sizes", "data/stale/{00000..00001}.tar", "--check",
          says=("00001.tar holds 12 samples, sizes.json lists 20", "to rewrite sizes.json")),
    index("index-check-damaged", "data/damaged_listed/00000.tar", "--check",
          says=("00000.tar is damaged", "Replace damaged shards")),
    index("index-check-unlisted", "data/empty_tar/00000.tar", "--check",
          says=("sizes.json does not list it", "index-shards")),
]  # fmt: skip


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 4 + 100)  # inside a member, before the 8th of 20 samples


@pytest.fixture(scope="module")
def workdir(module_tmp) -> Path:
    root = module_tmp("bad_data")
    data = root / "data"
    write_dataset(str(data / "good"), [98, 97, 0, 99, 6])
    write_dataset(str(data / "empty"), [0, 0])
    for name, table in (("sizes_list", [1, 2]), ("sizes_negative", {"00000.tar": -3})):
        write_dataset(str(data / name), [4])
        (data / name / "sizes.json").write_text(json.dumps(table))
    write_dataset(str(data / "empty_tar"), [0])
    os.remove(data / "empty_tar" / "sizes.json")
    write_dataset(str(data / "damaged"), [20])
    os.remove(data / "damaged" / "sizes.json")
    _truncate(str(data / "damaged" / "00000.tar"))
    write_dataset(str(data / "damaged_listed"), [20])
    _truncate(str(data / "damaged_listed" / "00000.tar"))
    write_dataset(str(data / "stale"), [12, 12])
    (data / "stale" / "sizes.json").write_text(json.dumps({"00000.tar": 12, "00001.tar": 20}))
    return root


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_data_gets_one_clear_line(case: Case, workdir: Path) -> None:
    check(case, cwd=workdir, protect=[workdir / "data"])


# Data a run reads on, counting what it skips (or reading it right), rather than refusing it: each
# shard below holds one defect that trained in silence before. The real training loader (what
# `bigclip train` runs, one rank, in this process) reads one epoch of it; the epoch's account must
# count the defect, or the images must be what the file holds.
def png16(level: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((12, 12), level, dtype=np.uint16)).save(out, format="PNG")
    return out.getvalue()


def shard_of(folder: Path, samples: list[dict], *, listed: int | None = None) -> str:
    folder.mkdir(parents=True)
    (folder / "00000.tar").write_bytes(tar_bytes(samples))
    (folder / "sizes.json").write_text(json.dumps({"00000.tar": len(samples) if listed is None else listed}))
    return str(folder / "00000.tar")


def with_repeated_member(folder: Path) -> str:
    """Sample 5 holds two .png members (the second is sample 6's image): webdataset refuses that."""
    folder.mkdir(parents=True)
    rng, out = random.Random(0), io.BytesIO()
    samples = [good_sample(f"k{i:04d}", rng) for i in range(16)]
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, sample in enumerate(samples):
            members = [
                ("png", sample["png"]),
                *([("png", samples[6]["png"])] if i == 5 else []),
                ("txt", sample["txt"]),
            ]
            for ext, data in members:
                data = data.encode() if isinstance(data, str) else data
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (folder / "00000.tar").write_bytes(out.getvalue())
    (folder / "sizes.json").write_text(json.dumps({"00000.tar": 16}))
    return str(folder / "00000.tar")


def read_epoch(pattern: str) -> tuple[list[str], list, Any]:
    """One epoch through the training loader: keys, uint8 images [H, W, 3], the epoch's account."""
    cfg = data_config(pattern, batch_size=4, workers=0)
    loader = build_train_loader(cfg, rank=0, world_size=1, seed=0, epoch=0, image_size=IMAGE_SIZE,
                                tokenizer=TOKENIZER, normalize=False)  # fmt: skip
    keys, images = [], []
    for batch in loader:
        keys += batch.keys
        images += list(batch.images)
    account = loader.account_epoch()
    loader.close()
    return keys, images, account


def test_16_bit_pngs_are_read_at_their_levels_not_white(tmp_path: Path) -> None:
    """PIL's convert('RGB') clips mode I;16 to 255: every such image trained as white."""
    levels = [4096 * i for i in range(16)]  # 0 .. 61440 of 65535
    keys, images, account = read_epoch(shard_of(tmp_path / "png16", [
        {"__key__": f"k{i:04d}", "png": png16(level), "txt": f"level {i}"} for i, level in enumerate(levels)]))  # fmt: skip
    assert sorted(keys) == [f"k{i:04d}" for i in range(16)] and account.clean
    for key, image in zip(keys, images):
        expected = levels[int(key[1:])] >> 8  # 16 bits scaled to 8
        assert abs(int(image.int().median()) - expected) <= 1, (key, int(image.int().median()), expected)


def test_empty_captions_are_skipped_and_counted(tmp_path: Path, caplog) -> None:
    rng = random.Random(0)
    samples = [good_sample(f"k{i:04d}", rng) for i in range(32)]
    for sample in samples[::4]:
        sample["txt"] = "  \n"
    with caplog.at_level(logging.WARNING, logger="bigclip.data"):
        keys, _, account = read_epoch(shard_of(tmp_path / "captions", samples))
    assert set(keys) == {s["__key__"] for s in samples[1::4] + samples[2::4] + samples[3::4]}
    assert (
        account.corrupt["empty_text"] == 8 and "corrupt samples skipped: 8 (empty_text: 8)" in account.line()
    )
    assert "skipping sample 'k0000'" in caplog.text and "empty_text" in caplog.text


def test_a_repeated_tar_member_skips_its_sample_with_a_count(tmp_path: Path) -> None:
    keys, _, account = read_epoch(with_repeated_member(tmp_path / "repeated"))
    assert "k0005" not in keys and len(keys) == len(set(keys)) == 12  # 15 read, whole batches of 4
    assert account.corrupt["duplicate_member"] == 1 and "duplicate_member: 1" in account.line()


def test_a_sizes_json_that_under_counts_is_a_warning_with_the_numbers(tmp_path: Path, caplog) -> None:
    """256 samples, 64 listed: the plan reads 64 (exact at any world size); the rest is named, not silent."""
    write_dataset(str(tmp_path / "under"), [256])
    (tmp_path / "under" / "sizes.json").write_text(json.dumps({"00000.tar": 64}))
    url = str(tmp_path / "under" / "00000.tar")
    with caplog.at_level(logging.WARNING, logger="bigclip.data"):
        keys, _, account = read_epoch(url)  # the account line is logged by the loader
    assert len(keys) == 64 and account.mismatched == {url: [MORE_THAN_LISTED, 64]} and not account.clean
    assert f"shard {url} holds more samples than the 64 sizes.json lists" in caplog.text
    assert "more than 64 (the rest not read) found, 64 listed" in account.line()
    assert [r.levelname for r in caplog.records if r.getMessage().startswith("data: epoch 0")] == ["WARNING"]
