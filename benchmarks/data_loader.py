"""Data-loader figures, side by side in one run: throughput, resume latency, per-step collectives.

  PYTHONPATH=$PWD python benchmarks/data_loader.py [--samples 4000] [--shards 4]

1. Throughput (samples/s over one epoch, worker start-up included) from local disk and from
   a loopback S3 server, with 0 and 2 workers.
2. Resume latency: time to the first batch when resuming near the end of every shard, with the
   byte cursor (seek / ranged GET) versus re-reading each shard up to the sample index (what a
   loader without byte offsets, or a compressed shard, must do).
3. The collectives the loader adds: the per-step "have a batch" MIN all-reduce and the
   position gather (`state_dict`), on 2 ranks over gloo.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.config import DataConfig  # noqa: E402
from bigclip.data import build_tokenizer, build_train_loader  # noqa: E402
from bigclip.data.loader import cpu_group  # noqa: E402
from bigclip.data.resume.position import DataPosition  # noqa: E402
from bigclip.data.shards import validate_shards  # noqa: E402
from bigclip.data.tar_samples import Cursor, ShardSamples  # noqa: E402
from bigclip.demo.data import write_demo_data  # noqa: E402
from bigclip.demo.loopback_s3 import LoopbackS3  # noqa: E402
from bigclip.distributed import spawn  # noqa: E402

BUCKET = "bigclip-bench"
IMAGE_SIZE = 64
BATCH = 64
TOKENIZER = build_tokenizer("hashing", context_length=32, vocab_size=49408)  # as when its figures were taken


def make_loader(pattern: str, *, workers: int, position: dict | None = None):
    cfg = DataConfig(train_data=pattern, batch_size=BATCH, workers=workers)
    return build_train_loader(
        cfg,
        rank=0,
        world_size=1,
        seed=0,
        epoch=0,
        image_size=IMAGE_SIZE,
        tokenizer=TOKENIZER,
        position=position,
    )


def throughput(pattern: str, *, workers: int) -> float:
    start = time.perf_counter()
    samples = sum(len(batch.keys) for batch in make_loader(pattern, workers=workers))
    return samples / (time.perf_counter() - start)


def late_position(pattern: str, *, with_bytes: bool) -> dict:
    """A position one batch before the end of every shard (byte -1: resume by skipping samples)."""
    shards = validate_shards(pattern)
    position = DataPosition.start_of(0, shards, resampled=False)
    for shard, url in enumerate(shards.urls):
        after = list(ShardSamples(url))[-BATCH - 1].after  # read once, outside the timing
        position.cursors[shard] = after if with_bytes else Cursor(after.index, -1)
    return position.to_json()


def first_batch_seconds(pattern: str, position: dict) -> float:
    start = time.perf_counter()
    next(iter(make_loader(pattern, workers=0, position=position)))
    return time.perf_counter() - start


def collective_costs(rank: int, world_size: int, pattern: str, repeats: int) -> dict:
    group = cpu_group()
    flag = torch.tensor([1], dtype=torch.int32)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    flag_us = (time.perf_counter() - start) / repeats * 1e6
    cfg = DataConfig(train_data=pattern, batch_size=8, workers=0)
    loader = build_train_loader(
        cfg, rank=rank, world_size=world_size, seed=0, epoch=0, image_size=IMAGE_SIZE, tokenizer=TOKENIZER
    )
    for _ in zip(range(20), loader):
        pass
    start = time.perf_counter()
    for _ in range(20):
        loader.state_dict()
    return {"flag_allreduce_us": flag_us, "state_dict_ms": (time.perf_counter() - start) / 20 * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LoopbackS3() as s3:
        s3.create_bucket(BUCKET)
        local = write_demo_data(
            tmp, samples=args.samples, shards=args.shards, val_samples=0, image_size=IMAGE_SIZE
        )
        remote = write_demo_data(
            f"s3://{BUCKET}/demo",
            samples=args.samples,
            shards=args.shards,
            val_samples=0,
            image_size=IMAGE_SIZE,
        )
        for source, pattern in (("local", local.train_pattern), ("s3", remote.train_pattern)):
            for workers in (0, 2):
                rows.append({"measure": "epoch samples/s", "source": source, "workers": workers,
                             "value": throughput(pattern, workers=workers)})  # fmt: skip
            seek = first_batch_seconds(pattern, late_position(pattern, with_bytes=True))
            skip = first_batch_seconds(pattern, late_position(pattern, with_bytes=False))
            rows.append({"measure": "resume first batch s (byte cursor)", "source": source, "value": seek})
            rows.append({"measure": "resume first batch s (skip by index)", "source": source, "value": skip})
            rows.append(
                {"measure": "resume speed-up (skip / cursor)", "source": source, "value": skip / seek}
            )
        costs = spawn(collective_costs, 2, local.train_pattern, 2000)[0]
    rows.append(
        {
            "measure": "flag all-reduce us/step (2 ranks, gloo)",
            "source": "-",
            "value": costs["flag_allreduce_us"],
        }
    )
    rows.append(
        {"measure": "state_dict gather ms (2 ranks, gloo)", "source": "-", "value": costs["state_dict_ms"]}
    )
    print_table(rows, ["measure", "source", "workers", "value"])
    write_results(
        "data_loader", rows, samples=args.samples, shards=args.shards, image_size=IMAGE_SIZE, batch_size=BATCH
    )


if __name__ == "__main__":
    main()
