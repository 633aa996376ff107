"""Dry run: rank 0 of N builds the real sharded model under torch's fake process group.

    python -m bigclip.plan.dryrun --gpus 1024 --model ViT-bigG-14 [training flags]   # prints JSON

`dist.init_process_group("fake", ...)` gives rank 0 of a world of N whose collectives return
at once without moving data, so the engines' own sharding code runs unchanged:
  FSDP2  the FSDP engine's `_shard` (fully_shard per block, then the root) on the meta-device
         model; then, under FakeTensorMode (tensors with shapes and dtypes but no storage), the
         rest of `FSDPEngine.build` (`to_empty`, the optimizer), one forward and backward on a
         synthetic batch and the engine's real `step`; gradients are counted after backward.
  ZeRO-3 the DeepSpeed engine's `_materialise` (the model built under `deepspeed.zero.Init`,
         each parameter partitioned as soon as its module exists: rank 0's partitions are real
         CPU tensors, a few MiB at these world sizes) and `deepspeed.initialize`, then the
         optimizer state a first step creates (`ensure_optimizer_state`, as before a resume).
         DeepSpeed checks tensors' storages (pinning, data_ptr), so FakeTensorMode is not used,
         and no forward is run: ZeRO-3 allocates its gradient accumulator at initialisation.
ZeRO-1/2 hold the whole model on every rank (5 GiB of bf16 for ViT-bigG-14), more than a dry
run on this class of machine should allocate; their plan is not dry-run. Each dry run belongs
in a fresh process (`run_dry_run`), so process groups and DeepSpeed's globals do not leak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

import torch
import torch.distributed as dist

from bigclip.cli_args import parse_train_args
from bigclip.config import TrainConfig
from bigclip.distributed import Runtime
from bigclip.errors import ConfigError
from bigclip.plan.spec import PlanSpec, from_train_config
from bigclip.storage.progress import progress_bar

CPU = torch.device("cpu")


def init_fake_group(world: int) -> Runtime:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return Runtime(rank=0, world_size=world, local_rank=0, device=CPU)


def _bytes(tensors: Any) -> int:
    """Bytes of these tensors (a DTensor counts its local shard); each one is a distinct storage."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def fsdp_dry_run(cfg: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    from bigclip.engines.fsdp import FSDPEngine
    from bigclip.engines.optimizer import Precision, make_optimizer, param_groups
    from bigclip.models.from_config import build_model, synthetic_batch
    from bigclip.train.trainer import contrastive_loss

    phase(0)
    engine = FSDPEngine(cfg, runtime)
    engine.precision = Precision.from_name(cfg.engine.precision)
    model = build_model(cfg)
    if engine.precision.param_dtype != torch.float32:
        model.to(engine.precision.param_dtype)
    engine._shard(model)  # outside FakeTensorMode: the device mesh reads its rank map
    with FakeTensorMode(allow_non_fake_inputs=True):
        # FSDPEngine.build from here on (its weight init needs values, which fake tensors lack).
        model.to_empty(device=CPU)
        engine.module = model
        engine.replicated = [p for p in model.parameters() if not isinstance(p, DTensor)]
        engine.optimizer = make_optimizer(param_groups(model, weight_decay=cfg.optim.wd), cfg.optim)
        engine.scaler = None
        phase(1)
        loss = contrastive_loss(_dot_loss, engine.forward(*synthetic_batch(cfg)))
        engine.backward(loss)
        grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
        engine.step(lr=cfg.optim.lr)
        phase(2)
        return {
            "parameters": _bytes(model.parameters()),
            "gradients": grads,
            "optimizer": _optimizer_state_bytes(engine.optimizer),
        }


def _dot_loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: Any = None) -> torch.Tensor:
    """A loss with the real one's inputs and gradients' shapes (its own buffers are planned apart)."""
    return -(scale * (image * text).sum(-1)).mean()


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    # `step` counters are 0-dim CPU tensors in torch's AdamW (no device memory): not counted.
    return _bytes(
        v for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"
    )


def zero3_dry_run(cfg: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    from bigclip.engines.deepspeed_state import ensure_optimizer_state

    ds_engine = zero3_engine(cfg, runtime)
    zero = ds_engine.optimizer
    flats = list(zero.fp32_partitioned_groups_flat)
    ensure_optimizer_state(zero.optimizer, flats, [zero.sub_group_to_group_id[i] for i in range(len(flats))])
    phase(2)
    return {
        "parameters": _bytes(p.ds_tensor for p in ds_engine.module.parameters()),
        "gradients": _bytes([zero.grad_partitions_flat_buffer]),
        "optimizer": _bytes(flats) + _optimizer_state_bytes(zero.optimizer),
    }


def zero3_engine(cfg: TrainConfig, runtime: Runtime) -> Any:
    """Rank `runtime.rank`'s DeepSpeed ZeRO-3 engine (`deepspeed.initialize`'s), built as
    `DeepSpeedEngine.build` builds it but for the initial weights' values (the partitions hold
    whatever memory held): what a dry run, or a benchmark of the checkpoint state, needs."""
    from bigclip.engines.deepspeed import DeepSpeedEngine, scalar_parameter_fixes
    from bigclip.engines.optimizer import make_optimizer, param_groups
    from bigclip.models.from_config import build_model, model_factory

    phase(0)
    os.environ.update(RANK=str(runtime.rank), WORLD_SIZE=str(runtime.world_size), LOCAL_RANK="0")
    engine = DeepSpeedEngine(cfg, runtime)
    plan = engine.resolve_plan(build_model(cfg))
    if plan.stage != 3 or plan.offload_optimizer or plan.offload_param:
        raise ConfigError("the DeepSpeed dry run covers ZeRO-3 without offload (e.g. ds_configs/zero3.json)")
    engine.deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    with scalar_parameter_fixes():
        model = engine._materialise(build_model(cfg), rebuild=model_factory(cfg))
        engine._prepare_blocks(model)
        optimizer = make_optimizer(param_groups(model, weight_decay=cfg.optim.wd), cfg.optim)
        phase(1)
        ds_engine, *_ = engine.deepspeed.initialize(
            model=model, optimizer=optimizer, config=engine.plan.config, dist_init_required=False
        )
    return ds_engine


def dry_run(argv: list[str]) -> dict[str, Any]:
    """In this process (call it in a fresh one): the dry run of `--gpus N` + training flags."""
    gpus, train_argv = split_gpus(argv)
    cfg = parse_train_args(train_argv)
    spec = from_train_config(cfg, gpus=gpus)
    runtime = init_fake_group(gpus)
    torch.set_num_threads(1)
    result = fsdp_dry_run(cfg, runtime) if spec.engine == "fsdp" else _zero_dry_run(spec, cfg, runtime)
    return {"engine": spec.engine, "gpus": gpus, "model": spec.model, **result}


def _zero_dry_run(spec: PlanSpec, cfg: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    if spec.engine != "zero3":
        raise ConfigError(f"no dry run for {spec.engine}: it holds the whole model on every rank")
    return zero3_dry_run(cfg, runtime)


def split_gpus(argv: list[str]) -> tuple[int, list[str]]:
    rest, gpus = list(argv), None
    for i, arg in enumerate(rest):
        if arg == "--gpus" and i + 1 < len(rest):
            gpus = rest[i + 1]
            del rest[i : i + 2]
            break
        if arg.startswith("--gpus="):
            gpus = arg.split("=", 1)[1]
            del rest[i]
            break
    if gpus is None or not gpus.isdigit() or int(gpus) < 1:
        raise ConfigError("the dry run needs --gpus N (N >= 1)")
    return int(gpus), rest


PHASES = ("build the sharded model", "run the first step", "count state")
PHASE_PREFIX = "bigclip-dry-run-phase "


PHASES_ENV = "BIGCLIP_DRY_RUN_PHASES"


def phase(index: int) -> None:
    """Tell the parent (`run_dry_run`, which sets PHASES_ENV) which phase starts, for its bar."""
    if os.environ.get(PHASES_ENV):
        print(f"{PHASE_PREFIX}{index}", flush=True)


def run_dry_run(argv: list[str], *, timeout_s: float = 600, progress: bool = False) -> dict[str, Any]:
    """The dry run in a fresh subprocess, with a bar over its phases; its JSON result."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore",
        PHASES_ENV: "1",
    }
    command = [sys.executable, "-m", "bigclip.plan.dryrun", *argv]
    with (
        tempfile.TemporaryFile("w+") as stderr,
        progress_bar(len(PHASES), label="dry run", unit="phase", enabled=progress) as bar,
    ):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        killer = threading.Timer(timeout_s, proc.kill)
        killer.start()
        lines = []
        for line in proc.stdout:
            if line.startswith(PHASE_PREFIX):
                index = int(line[len(PHASE_PREFIX) :])
                bar.set_postfix_str(PHASES[index])
                bar.update(index - bar.n)
            elif line.startswith("{"):
                lines.append(line)
        returncode = proc.wait()
        killer.cancel()
        bar.update(len(PHASES) - bar.n)
        stderr.seek(0)
        errors = stderr.read()
    if returncode != 0 or not lines:
        raise RuntimeError(f"dry run {argv} failed ({returncode}):\n{errors[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(dry_run(list(sys.argv[1:] if argv is None else argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
