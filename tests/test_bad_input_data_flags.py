"""Bad data flags of `bigclip train`: what the flags alone settle (patterns, upsampling factors,
keys, counts) fails in well under a second, torch-free; shards that are not there fail before a
model is built. The shards and an earlier run stay as they were."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.bad_input import Case, bigclip, check

from bigclip.demo.shapes_data import write_demo_data

DATA = "data/train/{00000..00001}.tar"
BASE = ("--model", "tiny", "--logs", "logs", "--name", "fresh")
# Shards looked for after the process group is formed: torch and the data code are imported first.
LISTED_S = 15.0


def data(name: str, *flags: str, says: tuple[str, ...], train_data: str = DATA, **kw) -> Case:
    return Case(name, bigclip("train", *BASE, "--train-data", train_data, *flags), says, **kw)


CASES = [
    data("train-unbalanced-brace", says=("--train-data 'data/train/{00000..00001.tar'", "unbalanced braces",
                                         "/data/{00000..00099}.tar"), train_data="data/train/{00000..00001.tar"),
    data("train-unbalanced-in-second-source", says=("unbalanced braces in 'data/x/{0..1'",),
         train_data=DATA + "::data/x/{0..1"),
    data("val-unbalanced-brace", "--val-data", "data/val/00000}.tar", says=("--val-data", "unbalanced braces")),
    data("imagenet-val-unbalanced-brace", "--imagenet-val", "data/cls/{0..3.tar",
         says=("--imagenet-val", "unbalanced braces")),
    data("upsampling-without-resampled", "--train-data-upsampling-factors", "1::2",
         says=("--train-data-upsampling-factors needs --dataset-resampled",), train_data=DATA + "::" + DATA),
    data("upsampling-count-mismatch", "--dataset-resampled", "--train-data-upsampling-factors", "1::2::3",
         says=("'1::2::3'", "one non-negative number per '::' source", "(2 source(s))", "1::1"),
         train_data=DATA + "::" + DATA),
    data("upsampling-negative", "--dataset-resampled", "--train-data-upsampling-factors", "1::-2",
         says=("'1::-2'", "non-negative"), train_data=DATA + "::" + DATA),
    data("upsampling-all-zero", "--dataset-resampled", "--train-data-upsampling-factors", "0::0",
         says=("'0::0'", "not all zero"), train_data=DATA + "::" + DATA),
    data("upsampling-not-a-number", "--dataset-resampled", "--train-data-upsampling-factors", "one::two",
         says=("'one::two'", "e.g. 1::1"), train_data=DATA + "::" + DATA),
    data("upsampling-inf", "--dataset-resampled", "--train-data-upsampling-factors", "inf::1",
         says=("'inf::1'", "non-negative number"), train_data=DATA + "::" + DATA),
    # `--train-data data/train/{00000..00001}.tar` unquoted: the shell hands bigclip one word per shard.
    Case("train-pattern-expanded-by-the-shell",
         bigclip("train", *BASE, "--train-data", "data/train/00000.tar", "data/train/00001.tar"),
         ("unrecognized arguments: data/train/00001.tar", "did the shell expand an unquoted pattern? Quote it")),
    data("shard-interleave-zero", "--shard-interleave", "0", says=("--shard-interleave must be at least 1",)),
    data("text-key-empty", "--text-key", ";", says=("--text-key ';'", "e.g. --text-key txt")),
    data("image-key-blank", "--image-key", " ", says=("--image-key", "name the tar member suffix")),
    data("train-num-samples-negative", "--train-num-samples", "-5", says=("--train-num-samples",)),
    data("val-chunk-negative", "--val-retrieval-chunk-size", "-1", says=("--val-retrieval-chunk-size",)),
    data("tokenizer-unknown", "--tokenizer", "sentencepiece", says=("--tokenizer", "invalid choice")),
    data("dataset-type-synthetic", "--dataset-type", "synthetic", says=("--dataset-type synthetic",)),
    data("no-shard-matches", says=("matches no shard", "Check the path, the brace range"),
         train_data="data/train/{00010..00019}.tar", max_s=LISTED_S),
    data("val-no-shard-matches", "--val-data", "data/val/{00010..00011}.tar", says=("--val-data", "no shard"),
         max_s=LISTED_S),
    data("train-pattern-names-nothing", says=("--train-data '::' names no shard", "/data/{00000..00099}.tar"),
         train_data="::"),
    data("image-mean-on-the-255-scale", "--image-mean", "123.675", "116.28", "103.53", "--image-std", "58.395",
         "57.12", "57.375", says=("images are scaled to [0, 1]", "divided by 255")),
    data("train-pattern-pipe", says=("matches no shard", "pipe: commands are not run", "s3:// URIs"),
         train_data="pipe:cat data/train/{00000..00001}.tar", max_s=LISTED_S),
    data("train-pattern-glob", says=("matches no shard", "Glob patterns are not expanded", "brace range"),
         train_data="data/train/*.tar", max_s=LISTED_S),
    data("train-data-a-folder", says=("data/train is a folder", "name its shards", "data/train/{00000..00099}.tar"),
         train_data="data/train", max_s=LISTED_S),
    # Found from the first shard's first samples, not after an epoch's reading skipped every sample.
    data("image-key-absent", "--image-key", "bmp", says=("--train-data: none of the first", "--image-key 'bmp'",
         "they hold jpg", "set --image-key"), max_s=LISTED_S),
    data("text-key-absent", "--text-key", "caption.txt",
         says=("--train-data: none of the first", "--text-key 'caption.txt'", "set --text-key"), max_s=LISTED_S),
    # Captioned shards given as a classification set: every image would have been scored a miss.
    # Not "put a sizes.json beside the shards" where one is there, listing other shards.
    data("no-sizes-json", says=("cannot tell how many samples", "no sizes.json lists its shards (not captioned/00000.tar)",
         "bigclip index-shards 'captioned/{00000..00000}.tar'", "--train-num-samples N"),
         train_data="captioned/{00000..00000}.tar", max_s=LISTED_S),
    data("sizes-json-of-other-shards", says=("sizes.json lists 1 of its 2 shards (not renamed/00001.tar)",
         "bigclip index-shards"), train_data="renamed/{00000..00001}.tar", max_s=LISTED_S),
    data("imagenet-val-without-labels", "--imagenet-val", "captioned/{00000..00000}.tar", "--batch-size", "8",
         says=("--imagenet-val", "has no .cls label (it holds", "class index from its .cls member"), max_s=LISTED_S),
]  # fmt: skip


@pytest.fixture(scope="module")
def home(module_tmp) -> Path:
    home = module_tmp("data_flags")
    write_demo_data(
        str(home / "data"), samples=16, shards=2, val_samples=4, classify_samples=0, image_size=16
    )
    (home / "logs" / "exp").mkdir(parents=True)
    (home / "logs" / "exp" / "config.yaml").write_text("model: {model: tiny}\n")
    (home / "captioned").mkdir()  # training shards (images and captions, no .cls) with class names
    shutil.copy(home / "data" / "train" / "00000.tar", home / "captioned" / "00000.tar")
    (home / "captioned" / "classnames.txt").write_text("circle\nsquare\n")
    shutil.copytree(home / "data" / "train", home / "renamed")  # sizes.json lists 00000.tar and an old name
    (home / "renamed" / "sizes.json").write_text('{"00000.tar": 8, "old-00001.tar": 8}')
    return home


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_data_flag(case: Case, home: Path) -> None:
    check(case, cwd=home, protect=[home])  # refused after the data is listed: still no run folder
