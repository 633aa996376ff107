"""Run a few training steps of the tiny model with a real engine in a fresh process, on CUDA
(a world of one over NCCL) or on CPU (gloo), and report losses, weights and a checkpoint round
trip. The GPU tests compare a CUDA run with the CPU fp32 reference run by this same code.

    python tests/support/gpu_harness.py OUT.pkl '{"device": "cuda", "engine": "fsdp", ...}'
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import torch

from bigclip.distributed import free_port

HERE = Path(__file__).resolve()


def run_in_process(spec: dict, tmp: Path, *, timeout_s: float = 600) -> dict:
    """The harness in a fresh interpreter (its own process group and CUDA context)."""
    out = tmp / f"result-{spec['device']}-{spec['engine']}.pkl"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), str(HERE.parents[1])])}  # fmt: skip
    if spec["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run([sys.executable, str(HERE), str(out), json.dumps(spec)], env=env, timeout=timeout_s,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return pickle.loads(out.read_bytes())


def _config(spec: dict):
    from support.engine_harness import tiny_config

    flags = {"engine.precision": spec.get("precision", "fp32"), "optim.lr": 1e-4}
    if spec["engine"] == "zero3":
        flags |= {
            "engine.engine": "deepspeed",
            "engine.deepspeed_config": str(HERE.parents[2] / "ds_configs/zero3.json"),
        }
    return tiny_config(**flags)


def main(out: str, spec: dict) -> None:
    from bigclip.distributed import init_distributed
    from bigclip.engines import build_engine
    from bigclip.models.factory import create_model
    from bigclip.ops.loss.contrastive import build_loss
    from bigclip.train.trainer import train_step
    from support.engine_harness import global_batch

    cfg = _config(spec)
    runtime = init_distributed(device=spec["device"])
    engine = build_engine(cfg, runtime)
    engine.build(create_model(cfg.model.model, device="meta"))
    loss_fn, losses = build_loss(cfg.loss), []
    for step in range(spec.get("steps", 3)):
        images, texts = (t.to(runtime.device) for t in global_batch(step, 16))
        losses.append(train_step(engine, loss_fn, [(images, texts)], lr=cfg.optim.lr).loss.item())
    weights = {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}
    result = {"losses": losses, "weights": weights}
    if spec.get("checkpoint"):
        result["restored"] = checkpoint_round_trip(engine, cfg, runtime, Path(out).with_suffix(".ckpt"))
    Path(out).write_bytes(pickle.dumps(result))


def checkpoint_round_trip(engine, cfg, runtime, root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Save synchronously and asynchronously (pinned staging on CUDA), load each into a fresh engine."""
    from bigclip.checkpoint import CheckpointStore
    from bigclip.engines import build_engine
    from bigclip.models.factory import create_model

    store, restored = CheckpointStore(str(root)), {}
    store.save(engine.checkpoint_state(), step=1)
    store.async_save(engine.checkpoint_state(), step=2)
    store.wait()
    for step in (1, 2):
        fresh = build_engine(cfg, runtime)
        fresh.build(create_model(cfg.model.model, device="meta", seed=99))  # other weights until loaded
        store.load(fresh.checkpoint_state(), f"step_{step:08d}")
        restored[f"step {step}"] = {k: v.detach().float().cpu() for k, v in fresh.full_state_dict().items()}
    store.close()
    return restored


if __name__ == "__main__":
    sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]
    main(sys.argv[1], json.loads(sys.argv[2]))
