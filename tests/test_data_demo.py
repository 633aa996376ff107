"""`bigclip make-demo-data`: shards, counts, captions that describe the pixels, distinct held-out captions."""

import json
import os
import re
import tarfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from bigclip.cli import main as bigclip_main
from bigclip.data.decode import decode_sample
from bigclip.data.shards import validate_shards
from bigclip.data.tar_samples import ShardSamples
from bigclip.demo.report import DemoSummary, summary_lines
from bigclip.demo.shapes_data import BACKGROUNDS, COLOURS, POSITIONS, SIZES, all_attributes, write_demo_data
from bigclip.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SIZE = 64
# A shape's extent is about twice its radius: small and large are told apart halfway between the
# largest small one and the smallest large one.
LARGE_FROM = (SIZES["small"][1] + SIZES["large"][0]) * IMAGE_SIZE


@pytest.fixture(scope="module")
def demo(module_tmp):
    out = str(module_tmp("demo"))
    return out, write_demo_data(out, samples=90, shards=4, val_samples=60, image_size=IMAGE_SIZE, seed=1)


def decoded(pattern):
    return [decode_sample(raw) for url in validate_shards(pattern).urls for raw in ShardSamples(url)]


def nearest(pixel, palette: dict) -> str:
    return min(palette, key=lambda name: np.abs(np.asarray(palette[name]) - pixel).sum())


def shape_of(mask: np.ndarray) -> tuple[str, str]:
    """(size, shape) read back from the pixels of one colour: bounding box, fill, top vs bottom width."""
    rows, cols = np.nonzero(mask)
    height, width = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
    size = "large" if max(height, width) >= LARGE_FROM else "small"
    fill = mask.sum() / (height * width)
    if fill >= 0.9:
        return size, "square"
    if fill >= 0.7:
        return size, "circle"
    band = mask[rows.min() : rows.max() + 1]
    top, bottom = band[height // 5].sum(), band[4 * height // 5].sum()
    return size, "triangle" if top < 0.6 * bottom else "cross"


def test_shard_and_sample_counts(demo):
    out, data = demo
    shards = validate_shards(data.train_pattern)
    assert len(shards) == 4 and shards.total_samples == 90
    assert sorted(os.listdir(os.path.join(out, "train"))) == [f"0000{i}.tar" for i in range(4)] + [
        "sizes.json"
    ]
    assert validate_shards(data.val_pattern).total_samples == 60
    with tarfile.open(shards.urls[0]) as tar:  # plain webdataset layout: KEY.EXT members
        assert {n.rsplit(".", 1)[1] for n in tar.getnames()} >= {"txt", "json", "jpg"}


def test_captions_describe_the_drawn_pixels(demo):
    _, data = demo
    samples = decoded(data.train_pattern) + decoded(data.val_pattern)
    assert len(samples) == 150 and all(not isinstance(s, str) for s in samples)
    formats = set()
    for sample in samples:
        pixels = np.asarray(sample.image.convert("RGB"), dtype=np.int32)
        match = re.fullmatch(
            r"a (small|large) (\w+) (\w+) at the ([\w ]+) on a (\w+) background", sample.caption
        )
        size, colour, shape, position, background = match.groups()
        fx, fy = POSITIONS[position]
        centre = pixels[int(fy * 64), int(fx * 64)]
        far_corner = pixels[63 if fy <= 0.5 else 0, 63 if fx <= 0.5 else 0]
        palette = COLOURS | {f"bg-{k}": v for k, v in BACKGROUNDS.items()}
        assert nearest(centre, palette) == colour, sample.caption
        assert nearest(far_corner, palette) == f"bg-{background}", sample.caption
        names = list(palette)
        distance = np.stack([np.abs(pixels - np.asarray(palette[n])).sum(-1) for n in names])
        assert shape_of(distance.argmin(0) == names.index(colour)) == (size, shape), sample.caption
        formats.add(sample.image.format)
    assert formats == {"JPEG", "PNG", "WEBP"}


def test_held_out_captions_are_distinct(demo):
    _, data = demo
    captions = [s.caption for s in decoded(data.val_pattern)]
    assert len(captions) == len(set(captions)) == 60


def test_too_many_held_out_samples_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="distinct captions"):
        write_demo_data(str(tmp_path), samples=10, shards=1, val_samples=len(all_attributes()) + 1)


def test_cli_writes_data_and_prints_the_flags(tmp_path, capsys):
    assert (
        bigclip_main(
            ["make-demo-data", str(tmp_path), "--samples", "12", "--shards", "2", "--val-samples", "5"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"--train-data '{tmp_path}/train/{{00000..00001}}.tar'" in printed
    assert json.loads((tmp_path / "train" / "sizes.json").read_text()) == {"00000.tar": 6, "00001.tar": 6}
    assert (
        bigclip_main(["make-demo-data", str(tmp_path), "--samples", "2", "--shards", "3"]) == 2
    )  # clean error


def test_cli_shows_a_progress_bar_unless_told_not_to(tmp_path, capfd):
    assert bigclip_main(["make-demo-data", str(tmp_path / "a"), "--samples", "40", "--shards", "2",
                         "--val-samples", "10"]) == 0  # fmt: skip
    err = capfd.readouterr().err
    assert "demo data: 100%" in err and "50/50" in err  # 40 training + 10 held-out samples
    assert bigclip_main(["make-demo-data", str(tmp_path / "b"), "--samples", "40", "--shards", "2",
                         "--val-samples", "10", "--no-progress"]) == 0  # fmt: skip
    assert "demo data" not in capfd.readouterr().err


def summary(seed: int, i2t: float, t2i: float, top1: float | None) -> DemoSummary:
    return DemoSummary(seed=seed, loss_2_ranks=(3.1, 0.8), resumed_at=401, loss_1_rank=(0.75, 0.7),
                       checkpoints=[600, 500, 401], pairs=720, image_to_text=i2t, text_to_image=t2i, classes=4,
                       classify_images=2000, zeroshot_top1=top1, global_batch=64)  # fmt: skip


def test_the_readme_block_is_what_the_demo_prints_at_seed_0():
    """The demo prints summary_lines(its summary); the README renders the same lines from the
    seed-0 summary in benchmarks/results/demo_seed_spread.json, and each figure's range."""
    import importlib.util

    runs = [summary(1, 0.5, 0.6, 0.7), summary(0, 0.55, 0.62, None), summary(2, 0.45, 0.58, 0.66)]
    assert (
        DemoSummary.from_dict(json.loads(json.dumps(asdict(runs[0])))) == runs[0]
    )  # as summary.json holds it
    printed = summary_lines(runs[1])
    assert (
        "image -> text: 55.0%   text -> image: 62.0%" in printed[-1]
        and "720 pairs (chance 0.14%)" in printed[-2]
    )
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "benchmarks" / "doc_tables.py")
    doc_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc_tables)
    rows = [{"seed": r.seed, "wall_s": 420.0 + r.seed, "cpu_s": 660.0} for r in runs]
    rendered = doc_tables.demo_seed_spread(
        {"summaries": [asdict(r) for r in runs], "rows": rows, "device": "CPU (x86_64, 2 threads)"}
    )
    assert "```\n" + "\n".join(printed) + "\n```" in rendered  # seed 0's lines, verbatim
    assert "| held-out retrieval, image -> text | 55.0% | 45.0-55.0% | ±5.0 points |" in rendered
    assert "zero-shot" not in rendered.split("```")[-1]  # seed 0 printed none: no row for it
    assert "used 11 CPU-minutes at seed 0, 7 minutes of wall time on CPU (x86_64, 2 threads)" in rendered
