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

import json
import os
from pathlib import Path

import pytest
from support.bad_input import Case, bigclip, check
from test_data_common import write_dataset

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
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_data")
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
