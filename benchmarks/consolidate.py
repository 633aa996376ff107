"""Consolidation: peak memory and time of `bigclip consolidate` vs the tools people use today.

One run on one machine; every tool runs in a fresh process, and its peak RSS is that process's
VmHWM, which it reports at exit. The source files are read once before each measurement, so
every tool reads from the page cache.

  A. A ViT-H-14 checkpoint written by the training code (FSDP2 engine, CheckpointStore) on 2 CPU
     ranks, weights only (3.94 GB fp32; its Adam state would add 7.9 GB, which this 24 GiB box,
     shared with other jobs, cannot hold in a baseline that loads everything):
       bigclip consolidate  CKPT model.safetensors
       torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT, model.pt)
     and DCP's own Hugging Face safetensors machinery, on the same model state from the same 2
     ranks (the same engine saves CheckpointStore's copy and these; tensor names gain DCP's `model.`
     prefix, which the comparison strips):
       HuggingFaceStorageWriter(HF, save_distributed=True): each rank writes its shards as
         safetensors with DCP_SHARDING_INFO; then, in a fresh process,
         _consolidate_hf_safetensors.consolidate_safetensors_files(HF, OUT, {every name: 1})
         (one output file, model-00001-of-00001.safetensors; the names are read from the shards'
         headers first, as the function wants the mapping)
       HuggingFaceStorageWriter(HF, save_distributed=True, enable_consolidation=True): the same
         consolidation run by rank 0 inside dcp.save. Its peak is rank 0's VmHWM over the save
         (reset before it through /proc/self/clear_refs), so it includes that rank's resident
         engine (`rank_rss_before_gb`) and DCP's serialization of its shards; `consolidate_seconds`
         is the save's time less that of the sharded-only save before it.
     Each DCP row also says whether the tool checks a checksum while reading
     (`checksums_while_reading`, from its source in torch 2.13: the HF consolidation seeks and
     reads raw bytes, safetensors carries no checksum) and, for the HF consolidation, what a
     byte flipped in a shard's tensor data does (`flipped_byte`: a small probe run here).
  B. DeepSpeed ZeRO-3 on 2 CPU ranks (the bigclip DeepSpeed engine), weights + Adam state, saved
     twice from the same engine: through CheckpointStore (DCP, what bigclip writes) and with
     DeepSpeed's own `save_checkpoint` (what zero_to_fp32 reads; it cannot read DCP). ViT-L-14
     here: a ViT-H-14 ZeRO-3 engine with Adam needs ~20 GB across 2 CPU ranks.
       bigclip consolidate  DCP_CKPT model.safetensors                (weights)
       deepspeed.utils.zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict, safetensors)
       dcp_to_torch_save(DCP_CKPT)                                      (loads weights + Adam)
Outputs are compared tensor by tensor: bigclip's file must equal each baseline's bit for bit
(`differing` names any tensor that does not).

    PYTHONPATH=. python benchmarks/consolidate.py [--model ViT-H-14] [--zero3-model ViT-L-14]
        [--only fsdp-stock fsdp-hf zero3]

`--only` runs those groups (fsdp-stock: bigclip and dcp_to_torch_save on A; fsdp-hf: the DCP
Hugging Face rows on A, which still run bigclip consolidate, unrecorded, for the comparison;
zero3: B) and merges their rows into the existing results file: a row not re-run keeps its own
`date` and `commit`, and the ratios are recomputed against the bigclip row of the same checkpoint.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, git_commit, print_table, write_results  # noqa: E402
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


def write_fsdp_weights(rank: int, world: int, model: str, root: str, hf: str = "") -> tuple[str, dict]:
    """Worker: the FSDP2 engine's initial weights, saved through CheckpointStore (weights only);
    with `hf`, the same state also saved by DCP's HuggingFaceStorageWriter, sharded (HF/sharded)
    and then consolidated at save time (HF/at-save): rank 0's time and peak of each save."""
    engine = build_engine_for(rank, world, model)
    store = CheckpointStore(root)
    uri = store.save(
        {"model": engine.checkpoint_state()["model"]}, step=0, meta={"model": model, "engine": "fsdp"}
    )
    store.close()
    if not hf:
        return uri, {}
    return uri, {
        "sharded": save_hf(engine, f"{hf}/sharded", consolidate=False),
        "at-save": save_hf(engine, f"{hf}/at-save", consolidate=True),
    }


def save_hf(engine: Any, path: str, *, consolidate: bool) -> dict:
    """One dcp.save of the model state through HuggingFaceStorageWriter (every rank its shards);
    this rank's seconds, resident bytes before and peak resident bytes during the save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dist.barrier()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, so the peak below is the save's
    start = time.perf_counter()
    writer = HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=consolidate)
    dcp.save({"model": engine.checkpoint_state()["model"]}, storage_writer=writer)
    return {"seconds": time.perf_counter() - start, "rss_before": before, "peak": _status_bytes("VmHWM")}


def _status_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(text.split(f"{field}:", 1)[1].split()[0]) * 1024


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


def dcp_hf_code(sharded: Path, out: Path) -> str:
    """DCP's consolidation of HuggingFaceStorageWriter's shards into one file. The function takes
    the name -> output file mapping, so the names are read from the shards' headers first."""
    return (
        "import glob, os; from safetensors import safe_open; "
        "from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files; "
        f"names = {{}}\nfor f in sorted(glob.glob(os.path.join({str(sharded)!r}, '*.safetensors'))):\n"
        "    with safe_open(f, 'pt') as s: names.update(dict.fromkeys(s.keys(), 1))\n"
        f"os.makedirs({str(out)!r}); consolidate_safetensors_files({str(sharded)!r}, {str(out)!r}, names)"
    )


# What each tool checks while it reads (torch 2.13, deepspeed as installed), from their sources:
CHECKS = {
    "bigclip consolidate": "CRC-32 of every DCP payload against the writer's record, .metadata's SHA-256 "
    "against the manifest, while streaming; SHA-256 of the output into its manifest",
    "dcp_hf": "none: _consolidate_hf_safetensors seeks and reads raw byte ranges (no CRC or hash), "
    "and safetensors files carry no checksum",
    "torch.load": "none: torch.load of its files (torch.load does not check the zip records' CRC-32s)",
    "dcp_to_torch_save": "none: FileSystemReader torch.loads each item's bytes (no CRC or hash; "
    "torch.load does not check the zip records' CRC-32s)",
}


def flipped_byte_probe(work: Path) -> str:
    """What DCP's HF consolidation does with one byte flipped in a shard's tensor data (small state,
    one process): 'raised ...' or 'no error; output changed' / 'no error; output unchanged'."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    root = work / "flip"
    state = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    dcp.save(
        state, storage_writer=HuggingFaceStorageWriter(str(root / "in"), save_distributed=True), no_dist=True
    )
    (shard,) = glob.glob(str(root / "in" / "*.safetensors"))
    data = bytearray(Path(shard).read_bytes())
    data[-100] ^= 0x01  # inside the tensor's bytes (the data section is last)
    Path(shard).write_bytes(data)
    (root / "out").mkdir()
    try:
        consolidate_safetensors_files(str(root / "in"), str(root / "out"), {"w": 1})
    except Exception as e:  # noqa: BLE001 (whatever it raises is the finding)
        return f"raised {type(e).__name__}"
    (out,) = glob.glob(str(root / "out" / "*.safetensors"))
    changed = not torch.equal(load_file(out)["w"], state["w"])
    shutil.rmtree(root)
    return "no error; output changed" if changed else "no error; output unchanged"


def compare_files(ours: Path, theirs: Path, prefix: str = "") -> dict[str, Any]:
    """Tensors that differ between bigclip's file and `theirs` (whose names carry `prefix`): both
    values where small ({"bigclip": ..., "dcp": ...}), else "values differ"; "in one file only" for
    a name only one holds. {} when equal tensor by tensor."""
    from safetensors import safe_open

    with safe_open(ours, "pt") as a, safe_open(theirs, "pt") as b:
        names, their_names = a.keys(), b.keys()  # safe_open is not iterable
        mapped = {k.removeprefix(prefix): k for k in their_names}
        differ: dict[str, Any] = {name: "in one file only" for name in sorted(set(names) ^ set(mapped))}
        for name in names:
            if name in mapped:
                mine, other = a.get_tensor(name), b.get_tensor(mapped[name])
                if not torch.equal(mine, other):
                    small = mine.numel() <= 4
                    differ[name] = (
                        {"bigclip": mine.tolist(), "dcp": other.tolist()} if small else "values differ"
                    )
    return differ


def identical(ours: Path, theirs: dict[str, torch.Tensor]) -> bool:
    from safetensors import safe_open

    with safe_open(ours, "pt") as f:
        if set(f.keys()) != set(theirs):
            return False
        return all(torch.equal(f.get_tensor(k), tensor) for k, tensor in theirs.items())


def run_fsdp(work: Path, model: str, groups: set[str]) -> list[dict]:
    hf = work / "hf" if "fsdp-hf" in groups else None
    start = time.perf_counter()
    uri, saves = spawn(write_fsdp_weights, 2, model, str(work / "fsdp"), str(hf or ""))[0]
    print(
        f"wrote {uri}{' and its DCP Hugging Face twins' if hf else ''} in {time.perf_counter() - start:.0f}s"
    )
    src, ours, theirs = Path(uri), work / "fsdp-bigclip.safetensors", work / "fsdp-dcp.pt"
    checkpoint = {"checkpoint": f"{model} FSDP2 2 ranks, weights", "checkpoint_gb": _size(src) / GB}
    ours_row = measure("bigclip consolidate", bigclip_code(uri, ours), source=src, output=ours)
    rows = []
    if "fsdp-stock" in groups:
        rows = [ours_row, measure("dcp_to_torch_save", dcp_code(uri, theirs), source=src, output=theirs)]
        same = identical(
            ours, {f"{k}": v for k, v in torch.load(theirs, mmap=True, weights_only=True)["model"].items()}
        )
        theirs.unlink()
        for row in rows:
            row |= checkpoint | {"identical": same}
        rows[0] |= {"checksums_while_reading": True, "checks": CHECKS["bigclip consolidate"]}
        rows[1] |= {"checksums_while_reading": False, "checks": CHECKS["dcp_to_torch_save"]}
    if hf:
        rows += run_fsdp_hf(work, hf, saves, ours, checkpoint)
    return rows


def run_fsdp_hf(work: Path, hf: Path, saves: dict, ours: Path, checkpoint: dict) -> list[dict]:
    """DCP's HF consolidation offline (fresh process) and at save time, against bigclip's file."""
    sharded, out = hf / "sharded", work / "fsdp-dcp-hf"
    offline_row = measure(
        "DCP HF: consolidate_safetensors_files", dcp_hf_code(sharded, out), source=sharded, output=out
    )
    (offline,) = out.glob("*.safetensors")
    (at_save,) = (hf / "at-save").glob("*.safetensors")
    flipped = flipped_byte_probe(work)
    common = {"checksums_while_reading": False, "checks": CHECKS["dcp_hf"], "flipped_byte": flipped,
              "names": "DCP's are bigclip's with a `model.` prefix (stripped to compare)"}  # fmt: skip
    at_save_row = {
        "tool": "DCP HF: save + consolidate at save (rank 0)",
        "peak_rss_gb": saves["at-save"]["peak"] / GB,
        "seconds": saves["at-save"]["seconds"],
        "output_gb": at_save.stat().st_size / GB,
        "rank_rss_before_gb": saves["at-save"]["rss_before"] / GB,
        "consolidate_seconds": saves["at-save"]["seconds"] - saves["sharded"]["seconds"],
        "sharded_save": {"seconds": saves["sharded"]["seconds"], "rank_rss_before_gb":
                         saves["sharded"]["rss_before"] / GB, "peak_rss_gb": saves["sharded"]["peak"] / GB},
        "peak_is": "rank 0's VmHWM over dcp.save: its engine resident, its shards serialized, then the consolidation",
    }  # fmt: skip
    rows = []
    for row, output in ((offline_row, offline), (at_save_row, at_save)):
        differing = compare_files(ours, output, prefix="model.")
        extra = {"checkpoint_gb": _size(sharded) / GB, "output": output.name}
        rows.append(row | checkpoint | extra | {"identical": not differing, "differing": differing} | common)
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
    rows[0] |= {"checksums_while_reading": True, "checks": CHECKS["bigclip consolidate"]}
    rows[1] |= {"checksums_while_reading": False, "checks": CHECKS["torch.load"]}
    rows[2] |= {"checksums_while_reading": False, "checks": CHECKS["dcp_to_torch_save"]}
    return rows


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each baseline's peak RSS and time relative to bigclip's on the same checkpoint."""
    ours = {r["checkpoint"]: r for r in rows if r["tool"] == "bigclip consolidate"}
    for r in rows:
        base = ours.get(r["checkpoint"])
        r["rss_vs_bigclip"] = r["peak_rss_gb"] / base["peak_rss_gb"] if base else None
        r["time_vs_bigclip"] = r["seconds"] / base["seconds"] if base else None
    return rows


GROUPS = ("fsdp-stock", "fsdp-hf", "zero3")
PROTOCOL = (
    "one run per group; each tool in a fresh process after its source was read once (page cache warm); "
    "peak RSS = VmHWM of that process (read by itself at exit), except the at-save row (rank 0's VmHWM "
    "over its dcp.save); bigclip defaults: 16 MiB pieces, 4 read ahead"
)


def merged(new: list[dict], groups: set[str]) -> list[dict]:
    """`new` in place of the rows it re-measures (same checkpoint and tool) in the results file;
    the rows kept carry their own date and commit. All of `new` when every group ran."""
    path = RESULTS_DIR / "consolidate.json"
    if set(GROUPS) <= groups or not path.exists():
        return new
    old = json.loads(path.read_text())
    stamp = {"date": old.get("date"), "commit": old.get("commit")}
    fresh = {(r["checkpoint"], r["tool"]): r for r in new}
    rows = []
    for r in old["rows"]:
        key = (r["checkpoint"], r["tool"])
        rows.append(fresh.pop(key) if key in fresh else {**r, "date": r.get("date", stamp["date"]),
                                                         "commit": r.get("commit", stamp["commit"])})  # fmt: skip
    for r in fresh.values():  # new rows: after the last of their checkpoint's
        at = max((i + 1 for i, o in enumerate(rows) if o["checkpoint"] == r["checkpoint"]), default=len(rows))
        rows.insert(at, r)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ViT-H-14")
    parser.add_argument("--zero3-model", default="ViT-L-14")
    parser.add_argument("--workdir", default="/tmp/bigclip-bench-consolidate")
    parser.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS),
                        help="run these groups; the other rows are kept from the results file")  # fmt: skip
    args = parser.parse_args()
    groups = set(args.only)
    os.environ["DS_ACCELERATOR"] = "cpu"  # inherited by the spawned DeepSpeed ranks
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows: list[dict] = []
    try:
        if groups & {"fsdp-stock", "fsdp-hf"}:
            rows += run_fsdp(work, args.model, groups)
            shutil.rmtree(work)
            work.mkdir()
        if "zero3" in groups:
            rows += run_zero3(work, args.zero3_model)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stamp = {"date": None, "commit": git_commit()} if not set(GROUPS) <= groups else {}
    rows = with_ratios(merged([r | stamp for r in rows], groups))
    print_table(rows, ["checkpoint", "tool", "checkpoint_gb", "output_gb", "peak_rss_gb", "rss_vs_bigclip",
                       "seconds", "time_vs_bigclip", "identical", "checksums_while_reading"])  # fmt: skip
    path = write_results("consolidate", rows, protocol=PROTOCOL)
    if stamp:  # the rows measured now carry this run's date too
        data = json.loads(path.read_text())
        for r in data["rows"]:
            r["date"] = r["date"] or data["date"]
        path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
