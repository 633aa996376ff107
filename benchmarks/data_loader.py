"""bigclip's training data loader against OpenCLIP's webdataset pipeline, side by side.

  PYTHONPATH=$PWD python benchmarks/data_loader.py [--passes 3] [--cache /tmp/bigclip-photos]

Two sets of generated photo-like JPEGs (tests/support/photos.py: gradients, blurred shapes,
grain, quality 90), long side 400-800 px (3,072 images, ~90 KB) and 1024-1600 px (1,536 images,
~430 KB), in 8 plain LAION-style shards each (jpg + txt + json). On the same shards, both
loaders run one epoch with 2 workers, batch 64, 224 px, the same tokenizer:
  openclip-wds  OpenCLIP's get_wds_dataset + image_transform (benchmarks/openclip_wds_peer.py:
                written with PIL + torch step by step, torchvision cannot be installed here):
                float32 normalised batches out of the workers.
  bigclip       bigclip's TrainLoader (fast path: reduced JPEG decode, crop + bilinear resize in
                one call), uint8 batches out of the workers; normalisation is the device's job
                in training (a GPU kernel) and is measured apart (row "normalise on CPU").
Measured per pass: CPU time of the main process and its (exited, waited-for) worker processes
(getrusage SELF + CHILDREN, so other jobs on a shared box do not count), per sample; and wall
samples/s, worker start-up included. Passes alternate between the two loaders; medians are
reported. Floors (issue 15): CPU per sample >= 2.0x lower than the peer on 400-800 px and
>= 2.5x on 1024-1600 px; wall samples/s not lower than the peer's.
Also: the fast path's quality (PSNR against the exact path, OpenCLIP's full decode + bicubic,
on the first 200 images of each set), resuming mid-shard by byte cursor vs by skipping samples,
and the loader's per-step collectives on 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing
import os
import random
import resource
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from support.photos import write_photo_shards  # noqa: E402

from benchmarks.common import print_table, write_results  # noqa: E402
from benchmarks.openclip_wds_peer import get_wds_loader  # noqa: E402
from bigclip.config import DataConfig  # noqa: E402
from bigclip.data.decode import decode_image  # noqa: E402
from bigclip.data.device import image_normalizer  # noqa: E402
from bigclip.data.loader import build_train_loader  # noqa: E402
from bigclip.data.resume.position import DataPosition  # noqa: E402
from bigclip.data.shards import validate_shards  # noqa: E402
from bigclip.data.tar_samples import Cursor, ShardSamples  # noqa: E402
from bigclip.data.tokenizer import build_tokenizer  # noqa: E402
from bigclip.data.transforms import train_transform  # noqa: E402
from bigclip.distributed import cpu_group, spawn  # noqa: E402

SETS = {"400-800 px": ((400, 800), 3072, 2.0), "1024-1600 px": ((1024, 1600), 1536, 2.5)}
SHARDS, WORKERS, BATCH, SIZE = 8, 2, 64, 224
TOKENIZER = build_tokenizer(DataConfig().tokenizer, context_length=77, vocab_size=49408)


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bigclip_epoch(pattern: str, samples: int) -> int:
    cfg = DataConfig(train_data=pattern, batch_size=BATCH, workers=WORKERS)
    loader = build_train_loader(
        cfg, rank=0, world_size=1, seed=0, epoch=0, image_size=SIZE, tokenizer=TOKENIZER, normalize=False
    )
    return sum(len(batch.keys) for batch in loader)


def peer_epoch(pattern: str, samples: int) -> int:
    loader = get_wds_loader(
        pattern, num_samples=samples, batch_size=BATCH, workers=WORKERS, image_size=SIZE, tokenizer=TOKENIZER
    )
    return sum(len(texts) for _, texts in loader)


def measure(epoch, pattern: str, samples: int) -> dict:  # noqa: ANN001
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    n = epoch(pattern, samples)
    gc.collect()
    multiprocessing.active_children()  # reaps any worker not joined yet, so its CPU time counts
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    return {"samples": n, "cpu_ms_per_sample": cpu / n * 1e3, "samples_per_s": n / wall}


def compare(pattern: str, samples: int, passes: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"openclip-wds": [], "bigclip": []}
    loaders = {"openclip-wds": peer_epoch, "bigclip": bigclip_epoch}
    for p in range(passes):
        order = list(loaders) if p % 2 == 0 else list(reversed(loaders))  # alternate who goes first
        for name in order:
            runs[name].append(measure(loaders[name], pattern, samples))
            print(f"  pass {p} {name}: {runs[name][-1]}", flush=True)
    return runs


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def fast_path_quality(pattern: str, images: int = 200) -> dict:
    fast, exact = train_transform(SIZE, fast=True), train_transform(SIZE, fast=False)
    values = []
    for url in validate_shards(pattern).urls:
        for raw in ShardSamples(url):
            data = raw.files["jpg"]
            a = fast(decode_image(data, load=False), random.Random(raw.key))
            b = exact(decode_image(data, load=False), random.Random(raw.key))
            values.append(psnr(a, b))
            if len(values) == images:
                return {"psnr_mean_db": statistics.mean(values), "psnr_min_db": min(values)}
    return {"psnr_mean_db": statistics.mean(values), "psnr_min_db": min(values)}


def normalise_cpu_ms() -> float:
    normalizer, batch = (
        image_normalizer(DataConfig()),
        torch.randint(0, 256, (BATCH, SIZE, SIZE, 3), dtype=torch.uint8),
    )
    start = time.process_time()
    for _ in range(10):
        normalizer(batch)
    return (time.process_time() - start) / (10 * BATCH) * 1e3


def late_position(pattern: str, *, with_bytes: bool) -> dict:
    """A position one batch before the end of every shard (byte -1: resume by skipping samples)."""
    shards = validate_shards(pattern)
    position = DataPosition.start_of(0, shards, resampled=False)
    for shard, url in enumerate(shards.urls):
        after = list(ShardSamples(url))[-BATCH - 1].after  # read once, outside the timing
        position.cursors[shard] = after if with_bytes else Cursor(after.index, -1)
    return position.to_json()


def first_batch_seconds(pattern: str, position: dict) -> float:
    cfg = DataConfig(train_data=pattern, batch_size=BATCH, workers=0)
    start = time.perf_counter()
    loader = build_train_loader(
        cfg, rank=0, world_size=1, seed=0, epoch=0, image_size=SIZE, tokenizer=TOKENIZER, position=position
    )
    next(iter(loader))
    return time.perf_counter() - start


def collective_costs(rank: int, world_size: int, pattern: str, repeats: int) -> dict:
    flag = torch.tensor([1], dtype=torch.int32)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group())
    flag_us = (time.perf_counter() - start) / repeats * 1e6
    cfg = DataConfig(train_data=pattern, batch_size=8, workers=0)
    loader = build_train_loader(
        cfg, rank=rank, world_size=world_size, seed=0, epoch=0, image_size=32, tokenizer=TOKENIZER
    )
    for _ in zip(range(5), loader):
        pass
    start = time.perf_counter()
    for _ in range(20):
        loader.state_dict()
    return {"flag_allreduce_us": flag_us, "state_dict_ms": (time.perf_counter() - start) / 20 * 1e3}


def comparison_rows(name: str, runs: dict[str, list[dict]], floor: float) -> list[dict]:
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("cpu_ms_per_sample", "samples_per_s")}
           for k, v in runs.items()}  # fmt: skip
    rows = [{"set": name, "measure": k, "cpu ms/sample": m["cpu_ms_per_sample"], "samples/s": m["samples_per_s"],
             "passes": v} for (k, m), v in zip(med.items(), runs.values())]  # fmt: skip
    cpu_ratio = med["openclip-wds"]["cpu_ms_per_sample"] / med["bigclip"]["cpu_ms_per_sample"]
    wall_ratio = med["bigclip"]["samples_per_s"] / med["openclip-wds"]["samples_per_s"]
    rows.append({"set": name, "measure": f"CPU/sample: peer / bigclip (floor {floor}x)", "value": cpu_ratio,
                 "meets_floor": cpu_ratio >= floor})  # fmt: skip
    rows.append({"set": name, "measure": "wall samples/s: bigclip / peer (floor 1x)", "value": wall_ratio,
                 "meets_floor": wall_ratio >= 1.0})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--cache", default="", help="keep the generated shards here and reuse them")
    args = parser.parse_args()
    rows, load = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.cache or tmp
        for name, (long_side, samples, floor) in SETS.items():
            folder = os.path.join(root, f"photos_{long_side[0]}_{long_side[1]}_{samples}")
            pattern = os.path.join(folder, f"{{00000..{SHARDS - 1:05d}}}.tar")
            if not os.path.exists(os.path.join(folder, "sizes.json")):
                print(f"writing {samples} photo-like JPEGs, long side {long_side} px ...", flush=True)
                write_photo_shards(folder, samples=samples, shards=SHARDS, long_side=long_side)
            print(f"set {name}", flush=True)
            rows += comparison_rows(name, compare(pattern, samples, args.passes), floor)
            rows.append({"set": name, "measure": "fast path vs exact: PSNR dB (mean, min)",
                         "value": fast_path_quality(pattern)})  # fmt: skip
            load.append(os.getloadavg()[0])
            if name == "400-800 px":
                seek = first_batch_seconds(pattern, late_position(pattern, with_bytes=True))
                skip = first_batch_seconds(pattern, late_position(pattern, with_bytes=False))
                rows.append({"set": name, "measure": "resume first batch s: byte cursor / skip by index",
                             "value": [seek, skip], "speed-up": skip / seek})  # fmt: skip
                costs = spawn(collective_costs, 2, pattern, 2000)[0]
        rows.append(
            {"set": "-", "measure": "normalise on CPU (device = cpu) ms/sample", "value": normalise_cpu_ms()}
        )
        rows.append(
            {
                "set": "-",
                "measure": "flag all-reduce us/step (2 ranks, gloo)",
                "value": costs["flag_allreduce_us"],
            }
        )
        rows.append(
            {"set": "-", "measure": "state_dict gather ms (2 ranks, gloo)", "value": costs["state_dict_ms"]}
        )
    columns = ["set", "measure", "cpu ms/sample", "samples/s", "value", "speed-up", "meets_floor"]
    print_table(rows, columns)
    print(
        f"load average (1 min) during the run: {', '.join(f'{x:.2f}' for x in load)} on {os.cpu_count()} cores"
    )
    write_results("data_loader", rows, workers=WORKERS, batch_size=BATCH, image_size=SIZE, shards=SHARDS,
                  load_average=load)  # fmt: skip


if __name__ == "__main__":
    main()
