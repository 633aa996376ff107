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
from bigclip.distributed import Runtime
from bigclip.errors import ConfigError
from bigclip.plan.engine_plan import engine_plan
from bigclip.plan.spec import from_train_config
from bigclip.storage.progress import progress_bar

CPU = torch.device("cpu")


def init_fake_group(world: int) -> Runtime:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return Runtime(rank=0, world_size=world, local_rank=0, device=CPU)


def tensor_bytes(tensors: Any) -> int:
    """Bytes of these tensors (a DTensor counts its local shard); each one is a distinct storage."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def dot_loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: Any = None) -> torch.Tensor:
    """A loss with the real one's inputs and gradients' shapes (its own buffers are planned apart)."""
    return -(scale * (image * text).sum(-1)).mean()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    # `step` counters are 0-dim CPU tensors in torch's AdamW (no device memory): not counted.
    return tensor_bytes(
        v for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"
    )


def dry_run(argv: list[str]) -> dict[str, Any]:
    """In this process (call it in a fresh one): the dry run of `--gpus N` + training flags."""
    gpus, train_argv = split_gpus(argv)
    cfg = parse_train_args(train_argv)
    spec = from_train_config(cfg, gpus=gpus)
    runtime = init_fake_group(gpus)
    torch.set_num_threads(1)
    result = engine_plan(spec.engine).dry_run(cfg, runtime)
    return {"engine": spec.engine, "gpus": gpus, "model": spec.model, **result}


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
