"""Train a few steps with a real engine on synthetic batches, for multi-rank exactness tests.

Every step's global batch is drawn from a generator seeded by the step number; rank r takes
rows [r*b, (r+1)*b). So any world size sees the same global batch, and the loss trajectory
and final weights must not depend on how many ranks share the work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bigclip.config import TrainConfig
from bigclip.distributed import Runtime
from bigclip.engines import Engine, build_engine
from bigclip.models.from_config import build_model, model_factory
from bigclip.ops.loss.contrastive import build_loss
from bigclip.train.trainer import train_step


def tiny_config(**overrides: object) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.model = "tiny"
    cfg.engine.precision = "fp32"
    cfg.optim.lr, cfg.optim.warmup, cfg.optim.wd = 1e-3, 0, 0.1
    cfg.loss.local_loss = cfg.loss.gather_with_grad = True  # the exact global loss
    for key, value in overrides.items():
        section, name = key.split(".")
        if not hasattr(getattr(cfg, section), name):  # a renamed field must not pass unnoticed
            raise AttributeError(f"tiny_config: {key} is no config field")
        setattr(getattr(cfg, section), name, value)
    return cfg.validate()


def global_batch(
    step: int, size: int, *, image_size: int = 64, context: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    images = torch.randn(size, 3, image_size, image_size, generator=g)
    texts = torch.randint(1, 1000, (size, context), generator=g)
    texts[:, 10] = 49407  # end of text: the highest id in each sequence
    return images, texts


def make_engine(rank: int, world: int, cfg: TrainConfig) -> Engine:
    runtime = Runtime(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    engine = build_engine(cfg, runtime)
    engine.build(
        build_model(cfg), rebuild=model_factory(cfg)
    )  # applies patch dropout and grad checkpointing from the config
    torch.manual_seed(1234 + rank)  # patch dropout draws; after build, which may draw (zero.Init)
    return engine


def run_steps(engine: Engine, cfg: TrainConfig, steps: range, batch: int) -> list[float]:
    """Optimizer steps on the synthetic global batches; each rank takes its slice."""
    rank, world = engine.runtime.rank, engine.runtime.world_size
    loss_fn = build_loss(cfg.loss)
    local, k = batch // world, cfg.optim.accum_freq
    losses = []
    for step in steps:
        images, texts = global_batch(step, batch)
        mine = images[rank * local : (rank + 1) * local], texts[rank * local : (rank + 1) * local]
        micro = [(mine[0][i::k], mine[1][i::k]) for i in range(k)]
        out = train_step(engine, loss_fn, micro, lr=cfg.optim.lr)
        loss = out.loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def run_engine(rank: int, world: int, cfg_dict: dict, steps: int, batch: int) -> dict:
    """Worker for bigclip.distributed.spawn: returns the loss per step and the final full weights."""
    cfg = TrainConfig.from_dict(cfg_dict).validate()
    engine = make_engine(rank, world, cfg)
    losses = run_steps(engine, cfg, range(steps), batch)
    weights = engine.full_state_dict()
    return {"losses": losses, "weights": weights if rank == 0 else None}


def without_key_bias(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Drop the key slice of a fused QKV bias. Its true gradient is exactly zero (adding a
    constant to every key shifts each query's logits uniformly, which softmax ignores), so the
    gradient is rounding noise and Adam's normalisation turns that noise into real updates
    that differ with the reduction order. Nothing downstream depends on those values."""
    if name.endswith("attn.in_proj_bias"):
        q, _, v = tensor.chunk(3)
        return torch.cat([q, v])
    return tensor


def assert_same_weights(a: dict, b: dict, *, rtol: float) -> None:
    """Every tensor equal to `rtol` in norm-wise relative error, ||x - y|| / ||x||.

    (Element-wise comparison is not meaningful after Adam steps: entries whose gradient is near
    zero move by a fraction of an update that depends on float summation order.)"""
    assert a.keys() == b.keys()
    for name in a:
        x, y = without_key_bias(name, a[name]).double(), without_key_bias(name, b[name]).double()
        error = (x - y).norm() / x.norm().clamp(min=1e-12)
        assert error <= rtol, f"{name}: relative error {error:.3g} > {rtol}"
