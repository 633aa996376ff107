"""Run by the deepspeed launcher in test_engine_deepspeed_launcher.py (not a test itself).

Takes bigclip's own training flags (plus the launcher's --local_rank), sets up the process group
from the launcher's environment and trains a few steps on the synthetic global batches through
the same path as `bigclip.train.setup`: parse_train_args -> init_distributed -> build_engine ->
engine.build(build_model(cfg)) -> train_step. Rank 0 writes LOGS/launch_result.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_harness import global_batch

from bigclip.cli_args import parse_train_args
from bigclip.distributed import init_distributed
from bigclip.engines import build_engine
from bigclip.ops.contrastive import build_loss
from bigclip.run_setup import build_model
from bigclip.train_step import train_step


def main(argv: list[str]) -> None:
    cfg = parse_train_args(argv)
    runtime = init_distributed(backend=cfg.engine.dist_backend, device=cfg.engine.device)
    engine = build_engine(cfg, runtime)
    engine.build(build_model(cfg))
    loss_fn = build_loss(cfg.loss)
    b, losses = cfg.data.batch_size, []
    for step in range(cfg.optim.max_steps):
        images, texts = global_batch(step, b * runtime.world_size)
        mine = slice(runtime.rank * b, (runtime.rank + 1) * b)
        loss = train_step(engine, loss_fn, [(images[mine], texts[mine])], lr=cfg.optim.lr).loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    ranks = [None] * runtime.world_size
    dist.all_gather_object(
        ranks, {"rank": runtime.rank, "local_rank": runtime.local_rank, "arg": cfg.engine.local_rank}
    )
    weights = engine.full_state_dict()
    if runtime.is_main:
        Path(cfg.log.logs).mkdir(parents=True, exist_ok=True)
        torch.save(weights, Path(cfg.log.logs) / "weights.pt")
        result = {"world_size": runtime.world_size, "ranks": ranks, "losses": losses}
        (Path(cfg.log.logs) / "launch_result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
