"""`bigclip make-demo-data OUT`: synthetic captioned images a tiny CLIP can learn in minutes.

Each image shows one shape on a plain background; its caption names every attribute drawn:
"a large red circle at the top left on a black background". Five attributes (size, colour,
shape, position, background) give 720 distinct captions. Pixel noise, colour jitter and
position / size jitter make every image different, so matching needs the attributes, not
memorised pixels. The held-out set draws attribute combinations *without* replacement, so its
captions are distinct and retrieval among N held-out samples is well defined (chance = 1/N).

A classification set for zero-shot evaluation (`--imagenet-val`) labels new images by the
shape drawn (4 classes, chance 25%); its prompt templates are captions with every other
attribute filled in, so the text tower sees sentences like those it was trained on.

Layout (OUT is a directory or a prefix in an object store, e.g. s3://bucket/prefix; objects are
written from memory, each whole):
  OUT/train/{00000..K-1}.tar + sizes.json     webdataset shards: KEY.jpg|png|webp, KEY.txt, KEY.json
  OUT/val/{00000..}.tar + sizes.json          held-out set, same format
  OUT/classify/{00000..}.tar + classnames.txt + zeroshot_classification_templates.txt
                                              KEY.jpg|png|webp, KEY.cls (the shape's index)
"""

from __future__ import annotations

import io
import itertools
import json
import random
import tarfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from bigclip.cli_args import ArgumentParser
from bigclip.data.streams import data_location
from bigclip.errors import BigclipError, DataError
from bigclip.storage.progress import progress_bar
from bigclip.storage.schemes import is_local, local_path

SIZES = {"small": (0.14, 0.17), "large": (0.23, 0.27)}  # radius as a fraction of the image side
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 210, 30),
    "purple": (140, 40, 180),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "cross")
POSITIONS = {
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
    "center": (0.5, 0.5),
}
BACKGROUNDS = {"black": (15, 15, 15), "white": (240, 240, 240), "gray": (128, 128, 128)}
SHARD_SAMPLES_VAL = 1000
# bigclip.data.shards.SIZES_FILE, not imported from there: bigclip.data loads torch, and a bad option
# should fail in well under a second (tests/test_bad_input_demo.py checks the two names agree).
SIZES_FILE = "sizes.json"
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 8, 1024  # below 8 pixels no shape is drawn; above, a demo is no longer quick
FORMATS = ("jpg",) * 8 + ("png", "webp")  # mostly JPEG, some PNG / WebP to exercise every decoder


@dataclass(frozen=True)
class Attributes:
    size: str
    colour: str
    shape: str
    position: str
    background: str

    def caption(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} at the {self.position} on a {self.background} background"


def all_attributes() -> list[Attributes]:
    return [Attributes(*combo) for combo in itertools.product(SIZES, COLOURS, SHAPES, POSITIONS, BACKGROUNDS)]


def _shape_points(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":  # the centre is inside: apex above, base below it
        return [(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)]
    w = r / 3  # cross: two bars through the centre
    return [
        (cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w), (cx + r, cy + w), (cx + w, cy + w),
        (cx + w, cy + r), (cx - w, cy + r), (cx - w, cy + w), (cx - r, cy + w), (cx - r, cy - w), (cx - w, cy - w),
    ]  # fmt: skip


def _jitter(colour: tuple[int, int, int], rng: random.Random, amount: int = 15) -> tuple[int, ...]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in colour)


def draw(attrs: Attributes, *, image_size: int, rng: random.Random) -> Image.Image:
    """The image for `attrs`; the shape's nominal centre (POSITIONS, +-4% jitter) is always inside it."""
    s = image_size
    image = Image.new("RGB", (s, s), _jitter(BACKGROUNDS[attrs.background], rng))
    canvas = ImageDraw.Draw(image)
    fx, fy = POSITIONS[attrs.position]
    cx, cy = (fx + rng.uniform(-0.04, 0.04)) * s, (fy + rng.uniform(-0.04, 0.04)) * s
    r = rng.uniform(*SIZES[attrs.size]) * s
    fill = _jitter(COLOURS[attrs.colour], rng)
    if attrs.shape == "circle":
        canvas.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        canvas.polygon(_shape_points(attrs.shape, cx, cy, r), fill=fill)
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0, 6, (s, s, 3))
    pixels = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def encode(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt], quality=92)
    return out.getvalue()


def tar_bytes(samples: list[dict[str, bytes | str]]) -> bytes:
    """A webdataset shard in memory: members KEY.EXT in sample order (sorted extensions, as webdataset)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            key = sample["__key__"]
            for ext in sorted(k for k in sample if k != "__key__"):
                data = sample[ext].encode() if isinstance(sample[ext], str) else sample[ext]
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mode, info.mtime = len(data), 0o444, 0
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def make_sample(key: str, attrs: Attributes, *, image_size: int, fmt: str, rng: random.Random) -> dict:
    image = draw(attrs, image_size=image_size, rng=rng)
    return {
        "__key__": key,
        fmt: encode(image, fmt),
        "txt": attrs.caption(),
        "json": json.dumps(asdict(attrs)),
    }


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@dataclass(frozen=True)
class DemoData:
    train_pattern: str
    val_pattern: str
    train_samples: int
    val_samples: int
    classify_pattern: str = ""
    classify_samples: int = 0


class _Sink:
    """Writes named objects under OUT, a local directory or a prefix in an object store."""

    def __init__(self, out: str) -> None:
        self.out = out.rstrip("/")
        self.location = data_location(self.out)

    def url(self, name: str) -> str:
        return f"{self.out}/{name}"

    def write(self, name: str, data: bytes) -> None:
        try:
            self.location.write_bytes(name, data)
        except (BigclipError, *self.location.read_errors) as e:
            raise DataError(f"cannot write {self.url(name)} (does the folder or bucket exist?): {e}") from e


def _write_split(sink: _Sink, split: str, combos: list[Attributes], counts: list[int], **kw) -> str:
    rng: random.Random = kw.pop("rng")
    bar: tqdm = kw.pop("bar")
    sizes: dict[str, int] = {}
    it: Iterator[Attributes] = iter(combos)
    for shard, count in enumerate(counts):
        samples = [
            make_sample(f"{split}{shard:05d}_{i:05d}", next(it), fmt=FORMATS[i % len(FORMATS)], rng=rng, **kw)
            for i in range(count)
        ]
        sink.write(f"{split}/{shard:05d}.tar", tar_bytes(samples))
        sizes[f"{shard:05d}.tar"] = count
        bar.update(count)
    sink.write(f"{split}/{SIZES_FILE}", json.dumps(sizes, indent=1).encode())
    return sink.url(f"{split}/{{00000..{len(counts) - 1:05d}}}.tar")


def classify_templates() -> list[str]:
    """Captions with every attribute but the shape filled in, varied across templates."""
    names = [list(SIZES), list(COLOURS), list(POSITIONS), list(BACKGROUNDS)]
    return [
        Attributes(*(n[i % len(n)] for n in names[:2]), "{c}", *(n[i % len(n)] for n in names[2:])).caption()
        for i in range(12)
    ]


def _write_classify(sink: _Sink, count: int, *, image_size: int, rng: random.Random) -> str:
    """Shards of images labelled by shape (`.cls`), with class names and templates beside them."""
    combos, per_shard = all_attributes(), SHARD_SAMPLES_VAL
    for shard in range(max(1, -(-count // per_shard))):
        samples = []
        for i in range(shard * per_shard, min(count, (shard + 1) * per_shard)):
            attrs = rng.choice(combos)
            sample = make_sample(f"classify{i:06d}", attrs, image_size=image_size, fmt="jpg", rng=rng)
            samples.append(
                {"__key__": sample["__key__"], "jpg": sample["jpg"], "cls": str(SHAPES.index(attrs.shape))}
            )
        sink.write(f"classify/{shard:05d}.tar", tar_bytes(samples))
    sink.write("classify/classnames.txt", "\n".join(SHAPES).encode() + b"\n")
    sink.write(
        "classify/zeroshot_classification_templates.txt", "\n".join(classify_templates()).encode() + b"\n"
    )
    return sink.url(f"classify/{{00000..{max(0, -(-count // per_shard) - 1):05d}}}.tar")


def check_options(out: str, *, samples: int, shards: int, val_samples: int, classify_samples: int,
                  image_size: int) -> None:  # fmt: skip
    """Everything the options settle, before anything is written."""
    if not 0 < shards <= samples:
        raise DataError(f"--shards must be between 1 and --samples ({samples}), got {shards}")
    if not 0 <= val_samples <= len(all_attributes()):
        raise DataError(
            f"--val-samples must be 0..{len(all_attributes())} (the number of distinct captions), got {val_samples}"
        )
    if classify_samples < 0:
        raise DataError(
            f"--classify-samples must be 0 (no classification set) or more, got {classify_samples}"
        )
    if not MIN_IMAGE_SIZE <= image_size <= MAX_IMAGE_SIZE:
        raise DataError(f"--image-size must be {MIN_IMAGE_SIZE}..{MAX_IMAGE_SIZE} pixels, got {image_size}")
    if is_local(out):
        _check_local_out(local_path(out))


def _check_local_out(out: str) -> None:
    """A folder that holds demo data already is not written over; a file is not a folder."""
    path = Path(out)
    held = [path / split / SIZES_FILE for split in ("train", "val") if (path / split / SIZES_FILE).exists()]
    if held:
        raise DataError(f"{out} holds demo data already ({held[0]}); give a new folder, or delete it first")
    folder = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not folder.is_dir():
        raise DataError(f"{out}: {folder} is a file, not a folder; give a folder for the shards")


def write_demo_data(
    out: str,
    *,
    samples: int,
    shards: int,
    val_samples: int,
    classify_samples: int = 400,
    image_size: int = 64,
    seed: int = 0,
    progress: bool = False,
) -> DemoData:
    """Write the training shards and the held-out set; returns their shard patterns."""
    combos = all_attributes()
    if not 0 < shards <= samples:
        raise DataError(f"--shards must be between 1 and --samples ({samples}), got {shards}")
    if not 0 <= val_samples <= len(combos):
        raise DataError(
            f"--val-samples must be 0..{len(combos)} (the number of distinct captions), got {val_samples}"
        )
    rng = random.Random(seed)
    train = [rng.choice(combos) for _ in range(samples)]
    held_out = rng.sample(combos, val_samples)  # without replacement: distinct captions
    sink = _Sink(out)
    val_shards = max(1, -(-val_samples // SHARD_SAMPLES_VAL))
    with progress_bar(samples + val_samples, label="demo data", unit="sample", enabled=progress) as bar:
        train_pattern = _write_split(
            sink, "train", train, _split(samples, shards), image_size=image_size, rng=rng, bar=bar
        )
        val_pattern = (  # 0: no held-out set at all (an empty shard would fail at the final evaluation)
            _write_split(
                sink,
                "val",
                held_out,
                _split(val_samples, val_shards),
                image_size=image_size,
                rng=rng,
                bar=bar,
            )
            if val_samples
            else ""
        )
    classify = (
        _write_classify(sink, classify_samples, image_size=image_size, rng=rng) if classify_samples else ""
    )
    return DemoData(train_pattern, val_pattern, samples, val_samples, classify, classify_samples)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="bigclip make-demo-data", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="Output directory or s3://bucket/prefix (the bucket must exist).")
    parser.add_argument("--samples", type=int, default=10000, help="Training samples.")
    parser.add_argument("--shards", type=int, default=10, help="Training shards.")
    parser.add_argument("--val-samples", type=int, default=500, help="Held-out samples, distinct captions.")
    parser.add_argument(
        "--classify-samples", type=int, default=400, help="Images labelled by shape, for --imagenet-val."
    )
    parser.add_argument("--image-size", type=int, default=64, help="Image side in pixels.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    args = parser.parse_args(argv)
    check_options(args.out, samples=args.samples, shards=args.shards, val_samples=args.val_samples,
                  classify_samples=args.classify_samples, image_size=args.image_size)  # fmt: skip
    demo = write_demo_data(
        args.out,
        samples=args.samples,
        shards=args.shards,
        val_samples=args.val_samples,
        classify_samples=args.classify_samples,
        image_size=args.image_size,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(f"wrote {demo.train_samples} training and {demo.val_samples} held-out samples")
    val = f" --val-data '{demo.val_pattern}'" if demo.val_pattern else ""
    print(f"  --train-data '{demo.train_pattern}'{val}")
    if demo.classify_pattern:
        print(
            f"  --imagenet-val '{demo.classify_pattern}'   ({demo.classify_samples} images of {len(SHAPES)} shapes)"
        )
    return 0
