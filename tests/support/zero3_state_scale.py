"""What rank 0 of a W-rank ZeRO-3 run builds for its checkpoint state, counted under torch's fake
process group (a real DeepSpeed engine for rank 0, `bigclip.plan.zero_plan.zero3_engine`).

    python tests/support/zero3_state_scale.py WORLD     # prints one line of JSON

Counted, for the model and optimizer state (`state_dict()` of the engine's Statefuls):
  entries, dims  sharded entries (parameters and their moments), and the sum of their dimensions
  boxes          boxes of the full tensors the entries describe (what a rank builds and keeps)
  boxes_old      the same by the old builder (tests/support/zero3_state_reference.py), which
                 described every rank's boxes
  write_items    DCP write items of rank 0's local save plan (DefaultSavePlanner, as a
                 rank-local save driver plans it)
Each world runs in a fresh process: one process group, and DeepSpeed's globals, per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def count(world: int) -> dict[str, int]:
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from bigclip.engines.deepspeed_layout import ZeroLayout
    from bigclip.engines.deepspeed_state import DeepSpeedModelState, DeepSpeedOptimState
    from bigclip.engines.local_shards import LocalShards
    from bigclip.plan.dryrun import init_fake_group
    from bigclip.plan.zero_plan import zero3_engine
    from support.engine_harness import tiny_config
    from support.zero3_state_reference import old_builder, zero3_owners

    torch.set_num_threads(1)
    runtime = init_fake_group(world)
    zero3 = {"engine.engine": "deepspeed", "engine.deepspeed_config": str(ROOT / "ds_configs/zero3.json")}
    ds_engine = zero3_engine(tiny_config(**zero3), runtime)
    layout = ZeroLayout(ds_engine)

    def state() -> dict[str, Any]:
        model = DeepSpeedModelState(layout, device=runtime.device)
        optim = DeepSpeedOptimState(layout, ds_engine.optimizer.optimizer, device=runtime.device, fp16=False)
        return flatten_state_dict({"model": model.state_dict(), "optim": optim.state_dict()})[0]

    new = state()
    planner = DefaultSavePlanner()
    planner.set_up_planner(new, is_coordinator=True)
    with old_builder(zero3_owners(layout, world)):
        old = state()
    return {
        "world": world,
        "entries": sum(isinstance(v, LocalShards) for v in new.values()),
        "dims": sum(v.dim() for v in new.values() if isinstance(v, LocalShards)),
        "boxes": sum(len(v.__create_chunk_list__()) for v in new.values() if isinstance(v, LocalShards)),
        "boxes_old": sum(
            len(v.metadata().shards_metadata) for v in old.values() if isinstance(v, ShardedTensor)
        ),
        "write_items": len(planner.create_local_plan().items),
    }


def run_count(world: int, *, timeout_s: float = 600) -> dict[str, int]:
    """`count(world)` in a fresh process."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [sys.executable, __file__, str(world)], capture_output=True, text=True, env=env, timeout=timeout_s
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"counting at {world} ranks failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(count(int(sys.argv[1]))))
