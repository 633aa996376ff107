"""Labelled image sets for zero-shot classification (`--imagenet-val`, `--imagenet-v2`).

Three layouts, as OpenCLIP and CLIP_benchmark read them:
  folder      DIR/<class>/<image>: torchvision's ImageFolder (classes in sorted folder order;
              ImageNet's val set after the usual `valprep.sh`)
  imagenet-v2 DIR/ImageNetV2-matched-frequency/<label>/<image>.jpeg (imagenetv2_pytorch's
              layout: the folder name is the label); DIR may also be that folder itself
  webdataset  shards (local or in an object store, a brace pattern) whose samples hold an image and `.cls`
              (the label as text), CLIP_benchmark's format
Class names: `classnames.txt` beside the set (one per line, in label order; for shards, in
their folder or its parent), else OpenCLIP's ImageNet class names when there are 1,000
classes, else the folder names. Prompt templates: `zeroshot_classification_templates.txt`
beside the set (one per line, `{c}` for the class name), else OpenCLIP's 80 ImageNet
templates. Nothing is ever downloaded.

Every rank reads only its share (files or shards index % world == rank) through a DataLoader
with worker processes; unreadable images are skipped and counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from bigclip.data.decode import IMAGE_EXTENSIONS, decode_image
from bigclip.data.shards import validate_shards
from bigclip.data.streams import data_location
from bigclip.data.tar_samples import ShardSamples, first_samples
from bigclip.data.transforms import eval_transform
from bigclip.errors import DataError
from bigclip.storage.schemes import is_local
from bigclip.storage.settings import StorageState

CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
V2_FOLDER = "ImageNetV2-matched-frequency"
FOLDER_IMAGES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Labels of what is not scored, each counted in the log: an image that could not be decoded, a
# sample without a `.cls` label or an image, a `.cls` that is no class index of the set.
SKIPPED, UNLABELLED, BAD_LABEL = -1, -2, -3


@cache
def imagenet_metadata() -> dict:
    """OpenCLIP's ImageNet class names and templates (copied with attribution, see the file)."""
    return json.loads((resources.files("bigclip.data") / "imagenet_zeroshot.json").read_text())


@dataclass
class ClassificationSet:
    uri: str
    classnames: list[str]
    templates: list[str]  # with `{c}` where the class name goes
    items: list[tuple[str, int]]  # (image path, label) for folders
    shards: list[str]  # webdataset shard URLs

    def prompts(self, classname: str) -> list[str]:
        return [t.replace("{c}", classname) for t in self.templates]

    def loader(
        self, *, rank: int, world_size: int, image_size: int, batch_size: int, workers: int,
        resize_mode: str = "shortest", interpolation: str = "bicubic",
    ) -> DataLoader:  # fmt: skip
        """Batches (uint8 images [B, S, S, 3], labels [B]) of this rank's share, resized and
        cropped as --val-data is (normalised on the device); label SKIPPED marks an image that
        could not be decoded."""
        transform = eval_transform(image_size, resize_mode=resize_mode, interpolation=interpolation)
        if self.items:
            data: Dataset = _Files(self.items[rank::world_size], transform)
        else:
            data = _Shards(self.shards, rank=rank, world_size=world_size, transform=transform,
                           classes=len(self.classnames))  # fmt: skip
        workers = min(workers, len(data) if isinstance(data, _Files) else len(data.mine))
        return DataLoader(data, batch_size=batch_size, num_workers=workers)


class _Files(Dataset):
    def __init__(self, items: list[tuple[str, int]], transform) -> None:  # noqa: ANN001
        self.items, self.transform = items, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        return _transformed(Path(path).read_bytes(), label, self.transform)


class _Shards(IterableDataset):
    """This rank's shards (or, with fewer shards than ranks, its samples), split among workers."""

    def __init__(self, shards: list[str], *, rank: int, world_size: int, transform, classes: int) -> None:  # noqa: ANN001
        by_shard = len(shards) >= world_size
        self.mine = shards[rank::world_size] if by_shard else shards
        self.stride, self.offset = (1, 0) if by_shard else (world_size, rank)
        self.transform, self.classes = transform, classes
        self.storage = StorageState.capture()  # restored in the (possibly spawned) worker

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        self.storage.restore()
        info = get_worker_info()
        shards = self.mine[info.id :: info.num_workers] if info else self.mine
        index = 0
        for url in shards:
            for raw in ShardSamples(url):
                if index % self.stride == self.offset:
                    image = next((raw.files[e] for e in IMAGE_EXTENSIONS if e in raw.files), None)
                    label = label_of(raw.files, self.classes) if image is not None else UNLABELLED
                    if label < 0:  # counted, not scored: a blank image stands in
                        yield _blank(self.transform), label
                    else:
                        yield _transformed(image, label, self.transform)
                index += 1


def label_of(files: dict[str, bytes], classes: int) -> int:
    """A sample's class index from its `.cls` member: UNLABELLED without one, BAD_LABEL when it is
    not an integer below `classes`."""
    if "cls" not in files:
        return UNLABELLED
    try:
        label = int(files["cls"].decode().strip())
    except (UnicodeDecodeError, ValueError):
        return BAD_LABEL
    return label if 0 <= label < classes else BAD_LABEL


def _blank(transform) -> torch.Tensor:  # noqa: ANN001
    return torch.zeros(transform.image_size, transform.image_size, 3, dtype=torch.uint8)


def _transformed(data: bytes, label: int, transform) -> tuple[torch.Tensor, int]:  # noqa: ANN001
    image = decode_image(data)
    if image is None:
        return _blank(transform), SKIPPED
    return torch.from_numpy(np.array(transform(image))), label  # a writable copy for the collate


def open_classification_set(uri: str, *, what: str) -> ClassificationSet:
    """The set at `uri`, checked (exists, has classes, names for them) before any model is built."""
    if uri.rstrip("/").endswith((".tar", ".tar.gz", ".tgz")) or "{" in uri:
        shards = list(validate_shards(uri, what=what).urls)
        folder = shards[0].rpartition("/")[0]
        here, parent = _texts(folder), _texts(folder.rpartition("/")[0])
        classnames, templates = here[0] or parent[0], here[1] or parent[1] or _default_templates()
        if not classnames:
            raise DataError(f"{what} {uri}: no {CLASSNAMES_FILE} beside the shards or in their parent folder")
        _check_first_samples(shards[0], len(classnames), what=f"{what} {uri}")
        return ClassificationSet(uri, classnames, templates, [], shards)
    if not is_local(uri):
        raise DataError(f"{what} {uri}: a set in an object store must be webdataset shards (a .tar pattern)")
    return _folder_set(uri, what=what)


def _check_first_samples(shard: str, classes: int, *, what: str) -> None:
    """A set whose samples carry no class index (e.g. --val-data's captioned shards given as
    --imagenet-val) fails before any model is built, from its first samples, not with a score of 0
    after training; one bad sample among them is only counted later, as the rest are."""
    samples = first_samples(shard)
    if not samples:
        return  # an empty or damaged shard: its reading says so, counted
    first = samples[0]
    holds = f"(it holds {', '.join(sorted(first.files)) or 'nothing'})"
    if not any(e in sample.files for sample in samples for e in IMAGE_EXTENSIONS):
        raise DataError(f"{what}: none of the first {len(samples)} samples of {shard} has an image; sample "
                        f"{first.key} {holds[1:-1]}: give a classification set of images with .cls labels")  # fmt: skip
    if any(label_of(sample.files, classes) >= 0 for sample in samples):
        return
    if label_of(first.files, classes) == UNLABELLED:
        raise DataError(f"{what}: sample {first.key} of {shard} has no .cls label {holds}, nor do the next "
                        f"{len(samples) - 1}: zero-shot classification reads each image's class index from its "
                        ".cls member")  # fmt: skip
    label = first.files["cls"][:40].decode(errors="replace")
    raise DataError(f"{what}: sample {first.key} of {shard} has .cls {label!r}, not a class index below the "
                    f"{classes} classes of its {CLASSNAMES_FILE}, nor do the next {len(samples) - 1} have one")  # fmt: skip


def _folder_set(uri: str, *, what: str) -> ClassificationSet:
    root = Path(uri)
    if what == "--imagenet-v2" and (root / V2_FOLDER).is_dir():
        root = root / V2_FOLDER
    if not root.is_dir():
        raise DataError(f"{what} {uri}: no such folder (bigclip never downloads evaluation sets)")
    folders = sorted(e.name for e in os.scandir(root) if e.is_dir())
    numeric = what == "--imagenet-v2" or (bool(folders) and all(f.isdigit() for f in folders))
    labels = {f: int(f) if numeric else i for i, f in enumerate(folders)}
    items = [
        (os.path.join(root, f, name), labels[f])
        for f in folders
        for name in sorted(os.listdir(root / f))
        if name.lower().endswith(FOLDER_IMAGES)
    ]
    if not items:
        raise DataError(f"{what} {uri}: no images in class sub-folders (expected DIR/<class>/<image>)")
    count = max(labels.values()) + 1
    names, templates = _texts(str(root))
    if names and len(names) < count:
        raise DataError(
            f"{what} {uri}: {CLASSNAMES_FILE} names {len(names)} classes, the folders hold {count}"
        )
    classnames = names or _default_names(count, folders if not numeric else None, what=what, uri=uri)
    return ClassificationSet(str(root), classnames, templates or _default_templates(), items, [])


def _texts(folder: str) -> tuple[list[str], list[str]]:
    """(class names, templates) read from `folder`, each empty when its file is absent."""
    if not folder:
        return [], []
    location = data_location(folder)
    out = []
    for name in (CLASSNAMES_FILE, TEMPLATES_FILE):
        text = location.read_bytes(name).decode() if location.exists(name) else ""
        out.append([line.strip() for line in text.splitlines() if line.strip()])
    return out[0], out[1]


def _default_names(count: int, folders: list[str] | None, *, what: str, uri: str) -> list[str]:
    if count == len(imagenet_metadata()["classnames"]):
        return list(imagenet_metadata()["classnames"])
    if folders is not None:
        return [f.replace("_", " ") for f in folders]
    raise DataError(
        f"{what} {uri}: {count} numbered classes; put their names in {CLASSNAMES_FILE} beside them"
    )


def _default_templates() -> list[str]:
    return list(imagenet_metadata()["templates"])
