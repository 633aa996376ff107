"""What the planner plans: a run's shape (`PlanSpec`) and its model's static shape.

A PlanSpec is built from the same flags as training (`from_train_config`), so `bigclip plan`
describes exactly the run a training command would start: the engine's plan kind comes from the
engine itself (`Engine.plan_kind`: DeepSpeed's stage and buckets from its JSON, resolved by its own
`resolve_ds_config`, which fills bucket sizes and checks the file), sizes from the model's
`ModelShape`, which its family derives from the config without building the model (the model
contract's static half, models/shape.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bigclip.config import TrainConfig
from bigclip.engines import engine_class
from bigclip.engines.deepspeed_config import ZeroSettings
from bigclip.engines.optimizer import Precision
from bigclip.errors import ConfigError
from bigclip.models.families import model_shape
from bigclip.models.run_options import model_options
from bigclip.models.shape import ModelOptions, ModelShape

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class PlanSpec:
    model: str
    gpus: int
    batch_size: int  # per GPU, per micro-batch
    engine: str = "fsdp"  # an engine kind: engine_plan.py (fsdp, zero1, zero2, zero3)
    precision: str = "amp_bf16"
    optimizer: str = "adamw"
    accum_freq: int = 1
    grad_checkpointing: bool = False
    checkpoint_every: int = 1  # --grad-checkpointing-every
    checkpoint_policy: str = "full"  # --grad-checkpointing-policy
    patch_dropout: float = 0.0
    image_size: int = 0  # --force-image-size (0: the config's)
    context_length: int = 0  # --force-context-length (0: the config's)
    linear_kind: str = "none"
    int8_attention: bool = False
    linear_filter: str = "auto"  # --linear-filter: which linears the kind converts, by measured shape
    loss: str = "clip"
    loss_chunk_size: int = 0
    loss_exchange: str = "ring"
    local_loss: bool = False
    gather_with_grad: bool = False
    reshard_after_forward: bool = True
    fsdp_blocks_per_unit: int = 1  # FSDP2's blocks gathered together
    zero: ZeroSettings = field(default_factory=ZeroSettings)  # DeepSpeed's buckets (its engine's plan_kind)
    io_threads: int | None = None  # checkpoint objects per rank (None: the store's choice, by shard size)
    dist_backend: str = "nccl"  # prices the collectives (comm.py); --dist-backend, nccl on GPUs

    @property
    def dtypes(self) -> Precision:
        return Precision.from_name(self.precision)

    @property
    def linear_filter_family(self) -> str:
        """The GPU family whose measured shapes decide which linears the kind converts: the one
        named, or under auto the planned GPU's (Hardware's defaults describe an H100: Hopper)."""
        return "hopper" if self.linear_filter == "auto" else self.linear_filter

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accum_freq * self.gpus

    def model_shape(self) -> ModelShape:
        """The planned model's static shape (its family's, with the run's --force-* sizes, patch dropout and loss)."""
        options = ModelOptions(
            patch_dropout=self.patch_dropout, image_size=self.image_size, context_length=self.context_length,
            loss=self.loss,
        )  # fmt: skip
        return model_shape(self.model, options)

    def validate(self) -> PlanSpec:
        if self.gpus < 1 or self.batch_size < 1 or self.accum_freq < 1:
            raise ConfigError("--gpus, --batch-size and --accum-freq must be at least 1")
        self.model_shape()  # raises, listing the valid names
        return self


def from_train_config(cfg: TrainConfig, *, gpus: int) -> PlanSpec:
    """The plan of a training command's configuration on `gpus` GPUs (one rank per GPU): the
    engine says which plan kind its run is (Engine.plan_kind: DeepSpeed's stage from its JSON)."""
    options = model_options(cfg)
    width = model_shape(cfg.model.model, options).hidden_width
    engine, engine_fields = engine_class(cfg.engine.engine).plan_kind(cfg, gpus=gpus, model_width=width)
    return PlanSpec(
        model=cfg.model.model, gpus=gpus, batch_size=cfg.data.batch_size, engine=engine,
        precision=cfg.engine.precision, optimizer=cfg.optim.optimizer, accum_freq=cfg.optim.accum_freq,
        grad_checkpointing=cfg.model.grad_checkpointing, checkpoint_every=cfg.model.grad_checkpointing_every,
        checkpoint_policy=cfg.model.grad_checkpointing_policy, patch_dropout=cfg.model.force_patch_dropout,
        image_size=options.image_size, context_length=cfg.model.force_context_length,
        linear_kind=cfg.model.linear_kind, int8_attention=cfg.model.int8_attention,
        linear_filter=cfg.model.linear_filter, loss=cfg.loss.loss,
        loss_chunk_size=cfg.loss.loss_chunk_size, loss_exchange=cfg.loss.loss_exchange,
        local_loss=cfg.loss.local_loss, gather_with_grad=cfg.loss.gather_with_grad,
        reshard_after_forward=cfg.engine.reshard_after_forward,
        fsdp_blocks_per_unit=cfg.engine.fsdp_blocks_per_unit,
        dist_backend=cfg.engine.dist_backend or "nccl", **engine_fields,
    ).validate()  # fmt: skip


def dtype_bytes(dtype: torch.dtype) -> int:
    return DTYPE_BYTES[dtype]
