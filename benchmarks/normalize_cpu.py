"""The loader's image normalisation where the device is the CPU: before and after, side by side.

    PYTHONPATH=$PWD python benchmarks/normalize_cpu.py [--batch 64] [--size 224] [--rounds 7]

A batch of uint8 [B, H, W, 3] images, as the data workers deliver it, normalised into the
model's input ([B, 3, H, W], fp32 or bf16) by the training process (data/device.py):
  before  the code at main 97074c7: a float transpose, then (x / 255 - mean) / std in three
          out-of-place passes, then the cast (five passes over float32 and their temporaries);
  after   ImageNormalizer now: a uint8 transpose, then the same three operations with the
          uint8 -> float conversion inside the first and the cast inside the last, in place.
Both variants alternate within each round (same load on the machine); the table gives the
median over rounds of wall time and of the process's CPU time (steadier on a shared machine),
per batch and per sample, the ratio before/after, and whether the results are bitwise equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402

from bigclip.config import DataConfig  # noqa: E402
from bigclip.data.device import image_normalizer  # noqa: E402
from bigclip.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # noqa: E402


def before(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """ImageNormalizer.__call__ at main 97074c7, without the erase branch."""
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    scale = torch.full((1, 1, 1, 1), 255.0)

    def run(images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float()
        x = (x / scale - mean) / std
        return x.to(dtype, memory_format=torch.contiguous_format)

    return run


def timed(fn: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn(images)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(batch: int, size: int, rounds: int, dtype: torch.dtype) -> list[dict]:
    images = torch.randint(
        0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    variants = {"before": before(dtype), "after": image_normalizer(DataConfig(), dtype=dtype)}
    equal = torch.equal(variants["before"](images), variants["after"](images))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(timed(fn, images))
    rows = []
    for name, times in samples.items():
        wall = statistics.median(t[0] for t in times) * 1e3
        cpu = statistics.median(t[1] for t in times) * 1e3
        rows.append({"dtype": str(dtype).removeprefix("torch."), "variant": name, "wall_ms": wall,
                     "cpu_ms": cpu, "wall_ms_per_sample": wall / batch, "bitwise_equal": equal})  # fmt: skip
    for row in rows:
        row["wall_vs_after"] = row["wall_ms"] / rows[1]["wall_ms"]
        row["cpu_vs_after"] = row["cpu_ms"] / rows[1]["cpu_ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = [
        row
        for dtype in (torch.float32, torch.bfloat16)
        for row in measure(args.batch, args.size, args.rounds, dtype)
    ]
    print(f"batch {args.batch} x {args.size}px uint8 -> normalised, {torch.get_num_threads()} threads")
    print_table(rows)
    write_results("normalize_cpu", rows, batch=args.batch, size=args.size, rounds=args.rounds,
                  threads=torch.get_num_threads())  # fmt: skip


if __name__ == "__main__":
    main()
