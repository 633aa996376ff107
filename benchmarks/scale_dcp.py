"""DCP coordination at 64-1024 simulated ranks: rank 0's serial CPU per save, `.metadata`, resume reads.

    python benchmarks/scale_dcp.py [--worlds 64 128 256 512 1024] [--today-up-to 256]

Every rank's metadata comes from plan/checkpoint_sim.py (each rank's chunks as FSDP2 splits
ViT-bigG-14, DCP's own planner over them: the layout tests/test_checkpoint_rank_local.py checks
against real ranks). What rank 0 does serially, timed with time.process_time:
  today      DCP's coordinator: unpickle W local plans, `create_global_plan` (dedup, metadata,
             validation), pickle W plans back, unpickle W write-result lists, pickle `.metadata`
             (the steps `dcp.save` runs on rank 0 with the plans every rank sends it)
  first      bigclip's first save of a run: unpickle W pieces (the gather), the skeleton,
             assemble `.metadata`, hash it, the manifest's object list
  later      a later save: W digests, no piece (unchanged), assemble, hash, manifest
Plus the `.metadata` size and the bytes one rank reads to resume (today: all of `.metadata`;
bigclip: saved rank 0's record and its own). Today's path is run up to --today-up-to ranks
(its 1024-rank run alone takes over ten minutes of CPU here); the JSON says which rows ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import pickle
import time
from typing import Any

import torch
from common import print_table, write_results
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from bigclip.checkpoint import metadata_stream
from bigclip.checkpoint.save_commit import PieceCache
from bigclip.plan import checkpoint_sim

MODEL = "ViT-bigG-14"


def bigg_shapes() -> dict[str, tuple[int, ...]]:
    from bigclip.cli_args import parse_train_args
    from bigclip.models.from_config import build_model

    with torch.device("meta"):
        model = build_model(parse_train_args(["--model", MODEL, "--train-data", "x"]))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _plan_of(meta: Any) -> SavePlan:
    """The local plan a rank would send DCP's coordinator (its write items, planner data)."""
    items = []
    for key, value in meta.state_dict_metadata.items():
        if not hasattr(value, "chunks"):
            items.append(WriteItem(index=metadata_stream.MetadataIndex(key), type=WriteItemType.BYTE_IO))
            continue
        for chunk in value.chunks:
            data = TensorWriteData(chunk=chunk, properties=value.properties, size=value.size)
            index = metadata_stream.MetadataIndex(key, chunk.offsets)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
    return SavePlan(items, planner_data=meta.planner_data)


def today(plans: list[bytes], results: list[bytes]) -> float:
    """Rank 0's CPU in DCP's coordinator for one save (the steps `dcp.save` runs there), from what
    every rank sends it: its pickled local plan, then its pickled write results."""
    start = time.process_time()
    planner = DefaultSavePlanner()
    planner.set_up_planner({}, None, True)
    global_plans, meta = planner.create_global_plan([pickle.loads(p) for p in plans])
    for plan in global_plans:
        pickle.dumps(plan)
    meta.storage_data = {r.index: r.storage_data for blob in results for r in pickle.loads(blob)}
    pickle.dumps(meta)
    return time.process_time() - start


def sent_today(meta: Any) -> tuple[bytes, bytes]:
    """What a rank sends DCP's coordinator: its pickled local plan and write results."""
    results = [WriteResult(i, 0, s) for i, s in (meta.storage_data or {}).items()]
    return pickle.dumps(_plan_of(meta)), pickle.dumps(results)


def manifest_objects(world: int) -> dict[str, dict]:
    """The manifest's object list: each rank's shard file and record, `.metadata`."""
    objects = {f"__{r}_0.distcp": {"size": 1, "sha256": "0" * 64} for r in range(world)}
    return objects | {f"rank_{r:05d}.bigclip": {"size": 1, "sha256": "0" * 64} for r in range(world)}


def rank_metadata(shapes: dict[str, tuple[int, ...]], world: int, rank: int) -> Any:
    return checkpoint_sim.rank_metadata(shapes, engine="fsdp", world=world, rank=rank)


def _sent(shapes: dict[str, tuple[int, ...]], world: int, keys: list[str], ranks: range,
          with_today: bool) -> list[tuple[bytes, bytes | None, bytes | None]]:  # fmt: skip
    pickler, sent = metadata_stream.PiecePickler(), []
    for rank in ranks:
        meta = rank_metadata(shapes, world, rank)
        plan, results = sent_today(meta) if with_today else (None, None)
        sent.append((metadata_stream.rank_piece(meta, keys, pickler=pickler), plan, results))
    return sent


def every_rank_sends(
    shapes: dict[str, tuple[int, ...]], world: int, keys: list[str], *, with_today: bool
) -> list[tuple[bytes, bytes | None, bytes | None]]:
    """Every rank's piece (bigclip's gather) and, `with_today`, its plan and write results (DCP's),
    built over the machine's cores: building each rank's metadata with DCP's planner is most of
    this benchmark's time. Only bytes come back, what the ranks would send: moving the metadata
    objects themselves between processes would cost what the workers save."""
    workers = min(os.cpu_count() or 1, 8)
    if workers == 1:
        return _sent(shapes, world, keys, range(world), with_today)
    step = math.ceil(world / workers)
    spans = [(shapes, world, keys, range(r, min(r + step, world)), with_today) for r in range(0, world, step)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return [one for part in pool.starmap(_sent, spans) for one in part]


def ours(first: Any, pieces: list[bytes], *, cache: PieceCache) -> tuple[float, int]:
    """Rank 0's serial CPU for one commit (the gather's unpickling included) and `.metadata`'s size;
    `first` is rank 0's own metadata (the skeleton's source)."""
    digests = [hashlib.sha256(p).hexdigest() for p in pieces]
    needed = set(cache.missing(digests))
    gathered = [pickle.dumps(p if r in needed else None) for r, p in enumerate(pieces)]
    reports = pickle.dumps([(None, "k", d, {}, {}) for d in digests])
    start = time.process_time()
    pickle.loads(reports)
    cache.update(digests, [pickle.loads(g) for g in gathered])
    head, _ = metadata_stream.skeleton(first)
    data = metadata_stream.assemble(head, cache.pieces)
    hashlib.sha256(data).hexdigest()
    json.dumps(manifest_objects(len(pieces)))
    return time.process_time() - start, len(data)


def measure(worlds: list[int], *, today_up_to: int = 256, shapes: dict | None = None) -> list[dict[str, Any]]:
    shapes = shapes or bigg_shapes()
    rows = []
    for world in worlds:
        first, second = rank_metadata(shapes, world, 0), rank_metadata(shapes, world, 1)
        keys = metadata_stream.tensor_keys(first)
        sent = every_rank_sends(shapes, world, keys, with_today=world <= today_up_to)
        pieces = [piece for piece, _, _ in sent]
        today_s = None
        if world <= today_up_to:  # DCP's coordinator takes every rank's whole plan and results
            today_s = round(today([p for _, p, _ in sent], [r for _, _, r in sent]), 2)
        del sent
        cache = PieceCache()
        first_s, size = ours(first, pieces, cache=cache)
        later_s, _ = ours(first, pieces, cache=cache)
        rows.append(
            {
                "world": world,
                "today_rank0_cpu_s": today_s,
                "first_save_rank0_cpu_s": round(first_s, 2),
                "later_save_rank0_cpu_s": round(later_s, 2),
                "metadata_MB": round(size / 1e6, 1),
                "resume_read_per_rank_MB_today": round(size / 1e6, 1),
                "resume_read_per_rank_MB": round(
                    (len(pickle.dumps(first)) + len(pickle.dumps(second))) / 1e6, 2
                ),
            }
        )
        print_table(rows[-1:])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--today-up-to", type=int, default=256)
    args = parser.parse_args()
    rows = measure(args.worlds, today_up_to=args.today_up_to)
    print_table(rows)
    write_results("scale_dcp", rows, model=MODEL, engine="fsdp", today_up_to=args.today_up_to)


if __name__ == "__main__":
    main()
