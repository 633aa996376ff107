"""The sharding engine, numerics and process-group set-up."""

from __future__ import annotations

import re
from dataclasses import dataclass

from bigclip.config.fields import opt
from bigclip.config.precisions import PRECISIONS
from bigclip.errors import ConfigError

# --engine's values, each naming its Engine subclass ("module:Class", bigclip/engines/base.py),
# imported only when a run builds or checks it: DeepSpeed is heavy and optional. A new engine is
# that class and one `register_engine` (docs/extending.md); the flag's choices read this table when
# the parser is built, so a registration made before then is a choice.
ENGINES: dict[str, str] = {
    "fsdp": "bigclip.engines.fsdp:FSDPEngine",
    "deepspeed": "bigclip.engines.deepspeed:DeepSpeedEngine",
}


def register_engine(name: str, implementation: str) -> None:
    """Make `name` an --engine value built by `implementation` ("package.module:EngineClass")."""
    ENGINES[name] = implementation


@dataclass
class EngineConfig:
    # OpenCLIP main's --fsdp (FSDP2's fully_shard instead of DDP) is bigclip's default engine.
    engine: str = opt(
        "fsdp",
        "Sharding engine: torch FSDP2 or DeepSpeed ZeRO.",
        choices=ENGINES,
    )
    precision: str = opt(
        "amp_bf16", "Numerics: bf16/fp16 mixed, fp32, or bf16 everywhere.", choices=PRECISIONS
    )
    deepspeed_config: str = opt(
        "",
        "DeepSpeed JSON config: a path, or the name of one bigclip ships (zero1, zero2, zero3, "
        "zero3_offload, zero3_vit_bigg: ds_configs/); needed with --engine deepspeed.",
    )
    reshard_after_forward: bool = opt(True, "FSDP2: free gathered parameters after forward (ZeRO-3-like).")
    fsdp_blocks_per_unit: int = opt(
        1,
        "FSDP2: residual blocks gathered and reduced together, N consecutive ones a unit: fewer, larger "
        "collectives and fewer hooks a step (less host time), N blocks' parameters gathered at once.",
    )
    dist_backend: str = opt("", "torch.distributed backend (default: nccl on GPU, gloo on CPU).")
    dist_timeout: int = opt(
        1800,
        "Seconds any collective may wait before it fails (the process groups' timeout, gloo and NCCL): "
        "a dead or hung peer then ends the run instead of stalling it.",
    )
    step_timeout: float = opt(
        0.0,
        "Step watchdog: when no step finishes for this many seconds, every rank logs which ranks are "
        "stuck and where, and exits with 85 so the job is requeued from its last checkpoint "
        "(0: 10x the median step time, at least 300 s, from the 10th step on; negative: off).",
    )
    device: str = opt("", "Device (default: cuda:LOCAL_RANK when CUDA is present, else cpu).")
    local_rank: int = opt(
        -1,
        "Set by the deepspeed launcher (as --local_rank=N); the environment's LOCAL_RANK wins.",
    )
    dist_url: str = opt("env://", "Rendezvous: env:// only (MASTER_ADDR/PORT, set by torchrun and srun).")
    set_device_rank: bool = opt(True, "cuda:LOCAL_RANK; --no-set-device-rank: cuda:0 (one GPU per process).")

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r} is unknown; choose from {', '.join(ENGINES)}")
        if self.engine == "deepspeed" and not self.deepspeed_config:
            raise ConfigError("--engine deepspeed needs --deepspeed-config, e.g. --deepspeed-config zero3")
        if self.fsdp_blocks_per_unit < 1:
            raise ConfigError(f"--fsdp-blocks-per-unit must be at least 1, got {self.fsdp_blocks_per_unit}")
        if self.dist_timeout < 1:
            raise ConfigError(f"--dist-timeout must be at least 1 second, got {self.dist_timeout}")
        if self.dist_url not in ("", "env://"):
            raise ConfigError(
                f"--dist-url {self.dist_url}: bigclip rendezvouses through the environment (env://); set "
                "MASTER_ADDR and MASTER_PORT (torchrun and srun with bigclip's sbatch scripts do)"
            )
        if self.device and not re.fullmatch(r"(cpu|cuda)(:\d+)?", self.device):
            raise ConfigError(
                f"--device {self.device!r}: bigclip trains on cpu, cuda or cuda:N; use one of them"
            )
