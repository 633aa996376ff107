"""Consolidation: peak memory and time of `bigclip consolidate` vs the tools people use today.

One run on one machine; every tool runs in a fresh process, and its peak RSS is that process's
VmHWM, which it reports at exit. The source files are read once before each measurement, so
every tool reads from the page cache.

  A. A ViT-H-14 checkpoint written by the training code (FSDP2 engine, CheckpointStore) on 2 CPU
     ranks, weights only (3.94 GB fp32; its Adam state would add 7.9 GB, which this 24 GiB box,
     shared with other jobs, cannot hold in a baseline that loads everything):
       bigclip consolidate  CKPT model.safetensors
       torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT, model.pt)
  B. DeepSpeed ZeRO-3 on 2 CPU ranks (the bigclip DeepSpeed engine), weights + Adam state, saved
     twice from the same engine: through CheckpointStore (DCP, what bigclip writes) and with
     DeepSpeed's own `save_checkpoint` (what zero_to_fp32 reads; it cannot read DCP). ViT-L-14
     here: a ViT-H-14 ZeRO-3 engine with Adam needs ~20 GB across 2 CPU ranks.
       bigclip consolidate  DCP_CKPT model.safetensors                (weights)
       deepspeed.utils.zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict, safetensors)
       dcp_to_torch_save(DCP_CKPT)                                      (loads weights + Adam)
Outputs are compared tensor by tensor: bigclip's file must equal each baseline's bit for bit.

    PYTHONPATH=. python benchmarks/consolidate.py [--model ViT-H-14] [--zero3-model ViT-L-14]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_results  # noqa: E402
from bigclip.checkpoint import CheckpointStore  # noqa: E402
from bigclip.config import TrainConfig  # noqa: E402
from bigclip.distributed import Runtime, spawn  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GB = 1e9


def build_engine_for(rank: int, world: int, model: str, ds_config: str = ""):  # noqa: ANN201
    from bigclip.engines import build_engine
    from bigclip.models.from_config import build_model, model_factory

    cfg = TrainConfig()
    cfg.model.model, cfg.engine.precision, cfg.data.batch_size = model, "fp32", 1
    if ds_config:
        cfg.engine.engine, cfg.engine.deepspeed_config = "deepspeed", ds_config
    cfg.validate()
    engine = build_engine(
        cfg, Runtime(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    )
    engine.build(build_model(cfg), rebuild=model_factory(cfg))
    return engine


def write_fsdp_weights(rank: int, world: int, model: str, root: str) -> str:
    """Worker: the FSDP2 engine's initial weights, saved through CheckpointStore (weights only)."""
    engine = build_engine_for(rank, world, model)
    store = CheckpointStore(root)
    uri = store.save(
        {"model": engine.checkpoint_state()["model"]}, step=0, meta={"model": model, "engine": "fsdp"}
    )
    store.close()
    return uri


def write_zero3_both(rank: int, world: int, model: str, root: str, native: str) -> str:
    """Worker: one ZeRO-3 engine (weights + Adam state) saved as DCP and as DeepSpeed's own format."""
    engine = build_engine_for(rank, world, model, str(REPO / "ds_configs" / "zero3.json"))
    store = CheckpointStore(root)
    uri = store.save(engine.checkpoint_state(), step=0, meta={"model": model, "engine": "deepspeed"})
    store.close()
    engine.ds_engine.save_checkpoint(native, tag="step0")
    return uri


def warm(folder: Path) -> None:
    """Read every file once so each tool starts from the same (cached) state."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


# The child reports its own VmHWM (peak resident set since exec). Not ru_maxrss from wait4: on
# Linux a forked child starts with its parent's high-water mark, which exec keeps.
REPORT_PEAK = """
import atexit, re
def _peak():
    kb = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    open({report!r}, "w").write(str(kb * 1024))
atexit.register(_peak)
"""


def measure(label: str, code: str, *, source: Path, output: Path) -> dict:
    """Run `code` in a fresh Python process; wall time and peak RSS of that process."""
    warm(source)
    report = output.parent / f".peak-{output.name}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", REPORT_PEAK.format(report=str(report)) + code], env=env, check=True)
    seconds = time.perf_counter() - start
    peak = int(report.read_text())
    written = _size(output) if output.is_dir() else output.stat().st_size
    return {"tool": label, "peak_rss_gb": peak / GB, "seconds": seconds, "output_gb": written / GB}


def bigclip_code(src: str, out: Path) -> str:
    return f"from bigclip.cli import main; assert main(['consolidate', {src!r}, {str(out)!r}, '--no-progress']) == 0"


def dcp_code(src: str, out: Path) -> str:
    return f"from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; dcp_to_torch_save({src!r}, {str(out)!r})"


def zero_to_fp32_code(native: Path, out: Path) -> str:
    return (
        "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
        f"c({str(native)!r}, {str(out)!r}, max_shard_size=None, safe_serialization=True)"
    )


def identical(ours: Path, theirs: dict[str, torch.Tensor]) -> bool:
    from safetensors import safe_open

    with safe_open(ours, "pt") as f:
        if set(f.keys()) != set(theirs):
            return False
        return all(torch.equal(f.get_tensor(k), tensor) for k, tensor in theirs.items())


def run_fsdp(work: Path, model: str) -> list[dict]:
    start = time.perf_counter()
    uri = spawn(write_fsdp_weights, 2, model, str(work / "fsdp"))[0]
    print(f"wrote {uri} in {time.perf_counter() - start:.0f}s")
    src, ours, theirs = Path(uri), work / "fsdp-bigclip.safetensors", work / "fsdp-dcp.pt"
    rows = [
        measure("bigclip consolidate", bigclip_code(uri, ours), source=src, output=ours),
        measure("dcp_to_torch_save", dcp_code(uri, theirs), source=src, output=theirs),
    ]
    same = identical(
        ours, {f"{k}": v for k, v in torch.load(theirs, mmap=True, weights_only=True)["model"].items()}
    )
    for row in rows:
        row |= {
            "checkpoint": f"{model} FSDP2 2 ranks, weights",
            "checkpoint_gb": _size(src) / GB,
            "identical": same,
        }
    return rows


def run_zero3(work: Path, model: str) -> list[dict]:
    from safetensors.torch import load_file

    start = time.perf_counter()
    uri = spawn(write_zero3_both, 2, model, str(work / "zero3"), str(work / "zero3-native"))[0]
    print(f"wrote {uri} and its native twin in {time.perf_counter() - start:.0f}s")
    src, native = Path(uri), work / "zero3-native"
    ours, z2f, dcp_out = work / "zero3-bigclip.safetensors", work / "zero3-z2f", work / "zero3-dcp.pt"
    rows = [
        measure("bigclip consolidate", bigclip_code(uri, ours), source=src, output=ours),
        measure("zero_to_fp32", zero_to_fp32_code(native, z2f), source=native, output=z2f),
        measure("dcp_to_torch_save (+Adam)", dcp_code(uri, dcp_out), source=src, output=dcp_out),
    ]
    same_z2f = identical(ours, load_file(z2f / "model.safetensors"))
    same_dcp = identical(ours, torch.load(dcp_out, mmap=True, weights_only=True)["model"])
    for row, same, size in zip(rows, (same_z2f, same_z2f, same_dcp), (_size(src), _size(native), _size(src))):
        row |= {
            "checkpoint": f"{model} ZeRO-3 2 ranks, weights+Adam",
            "checkpoint_gb": size / GB,
            "identical": same,
        }
    return rows


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each baseline's peak RSS and time relative to bigclip's on the same checkpoint."""
    ours = {r["checkpoint"]: r for r in rows if r["tool"] == "bigclip consolidate"}
    for r in rows:
        base = ours[r["checkpoint"]]
        r["rss_vs_bigclip"] = r["peak_rss_gb"] / base["peak_rss_gb"]
        r["time_vs_bigclip"] = r["seconds"] / base["seconds"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ViT-H-14")
    parser.add_argument("--zero3-model", default="ViT-L-14")
    parser.add_argument("--workdir", default="/tmp/bigclip-bench-consolidate")
    args = parser.parse_args()
    os.environ["DS_ACCELERATOR"] = "cpu"  # inherited by the spawned DeepSpeed ranks
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        rows = run_fsdp(work, args.model)
        shutil.rmtree(work)
        work.mkdir()
        rows += run_zero3(work, args.zero3_model)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = with_ratios(rows)
    print_table(rows, ["checkpoint", "tool", "checkpoint_gb", "output_gb", "peak_rss_gb", "rss_vs_bigclip",
                       "seconds", "time_vs_bigclip", "identical"])  # fmt: skip
    write_results(
        "consolidate",
        rows,
        protocol="one run; each tool in a fresh process after its source was read once (page cache warm); "
        "peak RSS = VmHWM of that process (read by itself at exit); bigclip defaults: 16 MiB pieces, 4 read ahead",
    )


if __name__ == "__main__":
    main()
