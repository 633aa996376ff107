"""--remote-sync's checkpoint backup on the loopback S3 endpoint: bytes sent and delay.

Three measurements in one run, against one moto server (its own process):

  training   the real trainer (tiny model, 1 rank, fp32) with a local checkpoint folder and
             --remote-sync, a checkpoint every --every steps. Per checkpoint, from the run's log:
             its size, the bytes uploaded and copied server-side, and the delay from its local
             commit (manifest written) to its remote commit (remote manifest written).
  side by side   the newest of those checkpoints copied to a fresh prefix by CheckpointMirror
             (objects, one listing to check sizes, manifest last) vs boto3 `upload_file` of the
             same files (what `aws s3 sync` does), alternating, median of --repeats.
  unchanged  a synthetic state half of whose bytes never change (a frozen tower in its own
             shard file, as DCP writes one file per I/O thread): the second checkpoint's bytes
             uploaded vs its size; and a second sync round, which sends nothing.

    PYTHONPATH=. python benchmarks/remote_sync.py [--steps 32] [--every 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.checkpoint import CheckpointStore  # noqa: E402
from bigclip.checkpoint.mirror import CheckpointMirror  # noqa: E402
from bigclip.demo.loopback_s3 import LoopbackS3  # noqa: E402
from bigclip.demo.shapes_data import write_demo_data  # noqa: E402
from bigclip.storage.locations import LocalLocation, Location  # noqa: E402
from bigclip.train.remote_sync import open_target  # noqa: E402

BUCKET = "remote-sync-bench"
BACKED_UP = re.compile(
    r"backed up step_(\d+) to \S+: (\d+) of (\d+) bytes uploaded, (\d+) copied remotely, in ([\d.]+)s; "
    r"committed remotely ([\d.]+)s after its local commit"
)
MB = 1e6


def training_rows(s3: LoopbackS3, work: Path, *, steps: int, every: int) -> list[dict]:
    data = write_demo_data(str(work / "data"), samples=1536, shards=4, val_samples=32, seed=0)
    argv = [
        "--model",
        "tiny",
        "--train-data",
        data.train_pattern,
        "--precision",
        "fp32",
        "--batch-size",
        "32",
        "--workers",
        "1",
        "--epochs",
        "1",
        "--warmup",
        "5",
        "--max-steps",
        str(steps),
        "--save-every-n-steps",
        str(every),
        "--save-frequency",
        "0",
        "--log-every-n-steps",
        "8",
        "--logs",
        str(work / "logs"),
        "--name",
        "bench",
        "--remote-sync",
        f"s3://{BUCKET}/runs",
        "--remote-sync-frequency",
        "300",
    ]  # fmt: skip  (a commit, not the period, starts each copy)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "bigclip.train", *argv], env=env, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise SystemExit(f"training failed:\n{run.stderr[-3000:]}")
    rows = []
    for m in BACKED_UP.finditer(run.stdout):
        step, uploaded, total, copied, seconds, lag = m.groups()
        rows.append({"case": "training", "step": int(step), "size_MB": int(total) / MB,
                     "uploaded_MB": int(uploaded) / MB, "copied_MB": int(copied) / MB,
                     "uploaded/size": int(uploaded) / int(total), "copy_s": float(seconds),
                     "commit_to_remote_commit_s": float(lag)})  # fmt: skip
    return rows


def sync_target(uri: str) -> Location:
    """As --remote-sync opens it (boto3, fork-safe, three tries per request)."""
    return open_target(uri, protocol="s3")


def side_by_side(s3: LoopbackS3, folder: Path, *, repeats: int) -> dict:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    client = s3.client()
    mirror_s, plain_s = [], []
    for i in range(repeats):
        order = ("mirror", "plain") if i % 2 == 0 else ("plain", "mirror")
        for kind in order:
            prefix = f"side/{uuid.uuid4().hex[:8]}"
            started = time.perf_counter()
            if kind == "mirror":
                target = sync_target(f"s3://{BUCKET}/{prefix}")
                CheckpointMirror(LocalLocation(folder.parent), target, keep_last=1).sync()  # the newest only
                mirror_s.append(time.perf_counter() - started)
            else:
                for path in files:
                    client.upload_file(str(path), BUCKET, f"{prefix}/{folder.name}/{path.name}")
                plain_s.append(time.perf_counter() - started)
    size = sum(p.stat().st_size for p in files)
    mirror, plain = statistics.median(mirror_s), statistics.median(plain_s)
    return {"case": "side by side", "size_MB": size / MB, "mirror_s": mirror, "upload_file_s": plain,
            "mirror/upload_file": mirror / plain, "mirror_rounds_s": mirror_s, "upload_file_rounds_s": plain_s}  # fmt: skip


def unchanged_rows(s3: LoopbackS3, work: Path) -> list[dict]:
    frozen = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0))  # 16.8 MB
    store = CheckpointStore(str(work / "frozen"), io_threads=2)  # one file per tensor
    target = sync_target(f"s3://{BUCKET}/frozen/{uuid.uuid4().hex[:8]}")
    mirror = CheckpointMirror(store.location, target)
    rows = []
    for step in (1, 2):
        trained = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(step))
        store.save({"frozen": frozen, "trained": trained}, step=step)
        for report in mirror.sync():
            rows.append({"case": "half frozen", "step": report.step, "size_MB": report.total_bytes / MB,
                         "uploaded_MB": report.uploaded_bytes / MB, "copied_MB": report.copied_bytes / MB,
                         "uploaded/size": report.uploaded_bytes / report.total_bytes, "copy_s": report.seconds,
                         "commit_to_remote_commit_s": report.lag_s})  # fmt: skip
    again = mirror.sync()  # a round with nothing new
    rows.append({"case": "nothing new", "step": 2, "uploaded_MB": sum(r.uploaded_bytes for r in again) / MB})
    store.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, LoopbackS3() as s3:
        s3.create_bucket(BUCKET)
        work = Path(tmp)
        rows = training_rows(s3, work, steps=args.steps, every=args.every)
        newest = work / "logs" / "bench" / "checkpoints" / f"step_{args.steps:08d}"
        rows += unchanged_rows(s3, work)
        side = side_by_side(s3, newest, repeats=args.repeats)
    columns = ["case", "step", "size_MB", "uploaded_MB", "copied_MB", "uploaded/size", "copy_s",
               "commit_to_remote_commit_s"]  # fmt: skip
    print_table(rows, columns)
    print()
    print_table([side], ["case", "size_MB", "mirror_s", "upload_file_s", "mirror/upload_file"])
    write_results("remote_sync", [*rows, side], load_average_at_start=load,
                  endpoint="loopback moto server (one Python process) on the same host")  # fmt: skip


if __name__ == "__main__":
    main()
