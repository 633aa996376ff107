"""Loading a safetensors file with and without its SHA-256 checked as it streams.

One file (default 1 GiB of fp32, in 32 MiB tensors) written as `bigclip consolidate` writes it
(with its checksum manifest), read whole side by side, rounds alternating which goes first:

  checked    open_weights(FILE): the manifest's sizes, then one sequential pass hashing every
             byte, the last tensor handed out only after the SHA-256 matched (what registry
             blobs and consolidated files get)
  unchecked  the same reader without the records (ranged reads only: what it did before)

Two read patterns: `read_each` (whole tensors, 2 ahead: `--pretrained`) and `stream` (16 MiB
pieces, 4 ahead: `bigclip consolidate`). The file is on local disk, read warm from the page
cache: the hash's CPU cost against the fastest read there is.

    python benchmarks/weights_integrity.py [--gib 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.storage.locations import LocalLocation  # noqa: E402
from bigclip.storage.ranged_reads import BlobFolder  # noqa: E402
from bigclip.weights.dcp_reader import TensorInfo  # noqa: E402
from bigclip.weights.safetensors_format import SafetensorsReader  # noqa: E402
from bigclip.weights.safetensors_writer import plan_output, write_safetensors  # noqa: E402
from bigclip.weights.sources import open_weights  # noqa: E402

TENSOR_ELEMENTS = 8 << 20  # 32 MiB of fp32


def write_file(folder: Path, total_bytes: int) -> Path:
    count = max(1, round(total_bytes / (TENSOR_ELEMENTS * 4)))
    infos = [TensorInfo(f"layer{i:03d}.weight", torch.float32, (TENSOR_ELEMENTS,)) for i in range(count)]
    g = torch.Generator().manual_seed(0)
    pieces = ((info, torch.randn(TENSOR_ELEMENTS, generator=g)) for info in infos)
    plan = plan_output(str(folder / "model.safetensors"), infos)
    write_safetensors(plan, pieces, metadata={}, manifest={})
    return folder / "model.safetensors"


def reader(path: Path, *, checked: bool) -> SafetensorsReader:
    if checked:
        found = open_weights(str(path)).reader
        assert found.checked, "the manifest beside the file was not found"
        return found
    return SafetensorsReader(BlobFolder(LocalLocation(path.parent)), path.name)


def load(path: Path, *, checked: bool, pattern: str) -> float:
    start = time.perf_counter()
    r = reader(path, checked=checked)
    total = 0
    if pattern == "read_each":
        for _, tensor in r.read_each([i.name for i in r.tensors()]):
            total += tensor.numel()
    else:
        for _, piece in r.stream(r.tensors()):
            total += piece.numel()
    assert total == sum(i.numel for i in r.tensors())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="weights_integrity")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bigclip-weights-integrity-") as tmp:
        path = write_file(Path(tmp), int(args.gib * (1 << 30)))
        gb = path.stat().st_size / 1e9
        rows = []
        for pattern in ("read_each", "stream"):
            times: dict[bool, list[float]] = {True: [], False: []}
            load(path, checked=False, pattern=pattern)  # warm the page cache
            for r in range(args.repeats):
                for checked in (True, False) if r % 2 == 0 else (False, True):
                    times[checked].append(load(path, checked=checked, pattern=pattern))
            best = {k: min(v) for k, v in times.items()}
            rows.append({
                "pattern": pattern, "file_gb": round(gb, 3),
                "unchecked_s": round(best[False], 3), "checked_s": round(best[True], 3),
                "unchecked_median_s": round(statistics.median(times[False]), 3),
                "checked_median_s": round(statistics.median(times[True]), 3),
                "overhead_pct": round(100 * (best[True] / best[False] - 1), 1),
                "checked_gb_s": round(gb / best[True], 2),
            })  # fmt: skip
    print_table(rows)
    write_results(args.name, rows, file_gb=round(gb, 3), rounds=args.repeats)


if __name__ == "__main__":
    main()
