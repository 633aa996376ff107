"""The run's configuration: one dataclass per concern, composed into `TrainConfig`.

Every command-line flag is derived from a dataclass field (`batch_size` -> `--batch-size`),
so the dataclasses are the single source of truth for names, defaults, types and help.
Field names are OpenCLIP's where the concept is the same, so `open_clip_train.main`
command lines keep working. A YAML file (`--config run.yaml`) may set any field, flat
(`batch_size: 256`) or by section (`data: {batch_size: 256}`); flags override the file.

Field metadata understood by `bigclip.cli_args`:
  help     the flag's help text
  choices  allowed values
  aliases  extra flag names (e.g. OpenCLIP's `--use-bnb-linear` for `--int8`)
  convert  callable applied to a value given through an alias
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from bigclip.errors import ConfigError

PRECISIONS = ("amp_bf16", "amp", "fp32", "pure_bf16")
ENGINES = ("fsdp", "deepspeed")
LOSSES = ("clip", "siglip")
LOSS_EXCHANGES = ("ring", "allgather")
INT8_MODES = ("none", "switchback-global", "switchback-vectorwise", "switchback-memefficient")
OPTIMIZERS = ("adamw", "adamw8bit")

# OpenCLIP's `--use-bnb-linear` class names, mapped onto `--int8` modes.
_BNB_LINEAR_ALIASES = {
    "SwitchBackLinearGlobal": "switchback-global",
    "SwitchBackLinearGlobalMemEfficient": "switchback-memefficient",
    "SwitchBackLinearVectorwise": "switchback-vectorwise",
}


def _bnb_linear_to_int8(value: str) -> str:
    if value not in _BNB_LINEAR_ALIASES:
        raise ConfigError(
            f"--use-bnb-linear {value!r} is not supported; use one of {sorted(_BNB_LINEAR_ALIASES)} "
            f"or --int8 {{{','.join(INT8_MODES)}}}"
        )
    return _BNB_LINEAR_ALIASES[value]


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with CLI metadata."""
    meta["help"] = help
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    model: str = _opt("tiny", "Model config name (see `bigclip models`), e.g. ViT-bigG-14.")
    pretrained: str = _opt("", "Initial weights: a path, s3:// or https:// URI, or registry:NAME.")
    force_patch_dropout: float = _opt(
        0.0, "Fraction of image patches dropped during training (class token kept)."
    )
    grad_checkpointing: bool = _opt(False, "Recompute each residual block's activations in backward.")
    torchcompile: bool = _opt(False, "torch.compile each residual block.")
    int8: str = _opt(
        "none",
        "Run MLP linears as int8 SwitchBack layers.",
        choices=INT8_MODES,
        aliases=("--use-bnb-linear",),
        convert=_bnb_linear_to_int8,
    )
    int8_attention: bool = _opt(False, "With --int8, also swap the attention projections.")
    lock_image: bool = _opt(False, "Freeze the image tower (LiT); frozen weights get no optimizer state.")
    lock_image_unlocked_groups: int = _opt(
        0, "With --lock-image, leave the last N layer groups of the image tower trainable."
    )
    lock_image_freeze_bn_stats: bool = _opt(
        False, "OpenCLIP's flag for BatchNorm towers; refused: bigclip's ViT image towers have no BatchNorm."
    )
    lock_text: bool = _opt(False, "Freeze the text tower; frozen weights get no optimizer state.")
    lock_text_unlocked_layers: int = _opt(
        0, "With --lock-text, leave the last N layer groups of the text tower trainable."
    )
    lock_text_freeze_layer_norm: bool = _opt(
        False, "With --lock-text, freeze the LayerNorms of locked layers too (else they stay trainable)."
    )

    def validate(self) -> None:
        if not 0.0 <= self.force_patch_dropout < 1.0:
            raise ConfigError(f"--force-patch-dropout must be in [0, 1), got {self.force_patch_dropout}")
        if self.int8_attention and self.int8 == "none":
            raise ConfigError("--int8-attention needs an --int8 mode, e.g. --int8 switchback-global")
        from bigclip.models.lock import check_lock_options
        from bigclip.models.registry import get_model_config  # raises, listing valid names

        get_model_config(self.model)
        check_lock_options(self)


@dataclass
class DataConfig:
    train_data: str = _opt(
        "", "Training shards: a brace pattern, local or s3://, e.g. /data/{00000..00099}.tar."
    )
    val_data: str = _opt("", "Held-out shards for retrieval evaluation (same pattern syntax).")
    train_num_samples: int = _opt(0, "Samples per epoch (0: read sizes.json beside the shards).")
    val_num_samples: int = _opt(0, "Held-out samples to evaluate (0: all).")
    imagenet_val: str = _opt(
        "",
        "Zero-shot classification set: an ImageNet-layout folder (one sub-folder per class) or "
        "webdataset shards with .cls labels (classnames.txt beside them for non-ImageNet classes).",
    )
    imagenet_v2: str = _opt(
        "", "ImageNet-V2 for zero-shot classification: the folder holding ImageNetV2-matched-frequency/."
    )
    zeroshot_frequency: int = _opt(
        2, "Run zero-shot classification every N epochs and after the last one (0: never)."
    )
    dataset_resampled: bool = _opt(False, "Sample shards with replacement (an endless stream).")
    workers: int = _opt(4, "Data-loader worker processes per rank.")
    batch_size: int = _opt(64, "Batch size per GPU (per rank).")
    tokenizer: str = _opt(
        "simple",
        "Text tokenizer: built-in 'simple' (no download) or 'open_clip'.",
        choices=("simple", "open_clip"),
    )
    shard_interleave: int = _opt(
        4,
        "Shards each data worker reads at once, taking samples from them in random order "
        "(mixing without a shuffle buffer, which keeps resume exact).",
    )

    def validate(self) -> None:
        if self.shard_interleave < 1:
            raise ConfigError(f"--shard-interleave must be at least 1, got {self.shard_interleave}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1 (samples per rank), got {self.batch_size}")
        if self.workers < 0:
            raise ConfigError(f"--workers must be 0 or more, got {self.workers}")
        if self.train_num_samples < 0 or self.val_num_samples < 0:
            raise ConfigError("--train-num-samples and --val-num-samples must be 0 (auto) or positive")
        if self.zeroshot_frequency < 0:
            raise ConfigError(
                f"--zeroshot-frequency must be 0 (never) or positive, got {self.zeroshot_frequency}"
            )


@dataclass
class OptimConfig:
    optimizer: str = _opt("adamw", "Optimizer: torch AdamW or bitsandbytes' 8-bit AdamW.", choices=OPTIMIZERS)
    lr: float = _opt(5e-4, "Peak learning rate.")
    beta1: float = _opt(0.9, "Adam beta1.")
    beta2: float = _opt(0.98, "Adam beta2.")
    eps: float = _opt(1e-6, "Adam epsilon.")
    wd: float = _opt(0.2, "Weight decay (not applied to gains, biases, 1-d embeddings, logit scale/bias).")
    warmup: int = _opt(10000, "Linear warmup steps.")
    epochs: int = _opt(32, "Epochs to train.")
    max_steps: int = _opt(0, "Stop after this many optimizer steps in total (0: run all epochs).")
    lr_scheduler: str = _opt("cosine", "LR schedule after warmup.", choices=("cosine", "const"))
    grad_clip_norm: float = _opt(0.0, "Clip the global gradient norm to this value (0: off).")
    accum_freq: int = _opt(1, "Micro-batches per optimizer step (features cached, OpenCLIP semantics).")
    seed: int = _opt(0, "Random seed (weights, data order, patch dropout).")

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.accum_freq < 1:
            raise ConfigError(f"--accum-freq must be at least 1, got {self.accum_freq}")
        if self.epochs < 1 and self.max_steps < 1:
            raise ConfigError("set --epochs or --max-steps to at least 1")
        if self.warmup < 0 or self.wd < 0 or self.grad_clip_norm < 0:
            raise ConfigError("--warmup, --wd and --grad-clip-norm must not be negative")


@dataclass
class LossConfig:
    loss: str = _opt("clip", "Contrastive loss: CLIP softmax or SigLIP sigmoid.", choices=LOSSES)
    siglip: bool = _opt(False, "OpenCLIP's switch for --loss siglip.")
    local_loss: bool = _opt(False, "Logits of local features against global ones only (OpenCLIP semantics).")
    gather_with_grad: bool = _opt(False, "All-gather features with gradients (OpenCLIP semantics).")
    loss_chunk_size: int = _opt(
        0,
        "Compute the loss exactly in tiles of this many rows x columns (0: unchunked OpenCLIP loss). "
        "Per-rank loss memory is then O(local batch x (chunk + embed dim)), flat in the world size.",
    )
    loss_exchange: str = _opt(
        "ring",
        "How the chunked loss sees other ranks' features: 'ring' (chunks passed to the neighbour, "
        "flat memory) or 'allgather' (all features gathered, memory grows with the global batch).",
        choices=LOSS_EXCHANGES,
    )

    def validate(self) -> None:
        if self.siglip:
            self.loss = "siglip"
        if self.loss_chunk_size < 0:
            raise ConfigError(
                f"--loss-chunk-size must be 0 (unchunked) or positive, got {self.loss_chunk_size}"
            )
        if self.loss not in LOSSES:
            raise ConfigError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.loss_exchange not in LOSS_EXCHANGES:
            raise ConfigError(
                f"--loss-exchange must be one of {', '.join(LOSS_EXCHANGES)}, got {self.loss_exchange!r}"
            )


@dataclass
class EngineConfig:
    engine: str = _opt("fsdp", "Sharding engine: torch FSDP2 or DeepSpeed ZeRO.", choices=ENGINES)
    precision: str = _opt(
        "amp_bf16", "Numerics: bf16/fp16 mixed, fp32, or bf16 everywhere.", choices=PRECISIONS
    )
    deepspeed_config: str = _opt(
        "", "DeepSpeed JSON config (see ds_configs/); needed with --engine deepspeed."
    )
    reshard_after_forward: bool = _opt(True, "FSDP2: free gathered parameters after forward (ZeRO-3-like).")
    dist_backend: str = _opt("", "torch.distributed backend (default: nccl on GPU, gloo on CPU).")
    device: str = _opt("", "Device (default: cuda:LOCAL_RANK when CUDA is present, else cpu).")
    local_rank: int = _opt(
        -1,
        "Set by the deepspeed launcher (as --local_rank=N); the environment's LOCAL_RANK wins.",
        aliases=("--local_rank",),
        convert=int,
    )

    def validate(self) -> None:
        if self.engine == "deepspeed" and not self.deepspeed_config:
            raise ConfigError("--engine deepspeed needs --deepspeed-config, e.g. ds_configs/zero3.json")


@dataclass
class CheckpointConfig:
    checkpoint_dir: str = _opt(
        "", "Where checkpoints go: a path or s3://bucket/prefix (default: LOGS/NAME/checkpoints)."
    )
    save_frequency: int = _opt(1, "Save every N epochs (0: never at epoch ends).")
    save_every_n_steps: int = _opt(0, "Also save every N optimizer steps (0: off).")
    resume: str = _opt("", "Resume from 'latest', a checkpoint path, or an s3:// URI.")
    async_save: bool = _opt(False, "Stage state in CPU memory and upload in the background.")
    delete_previous_checkpoint: bool = _opt(False, "Keep only the newest local checkpoint.")
    keep_last: int = _opt(0, "Keep the newest K local checkpoints (0: all).")
    remote_keep_last: int = _opt(0, "Keep the newest K checkpoints on S3 (0: all).")
    allow_batch_size_change: bool = _opt(False, "Allow resuming with a different global batch size.")
    s3_endpoint: str = _opt("", "S3 endpoint URL (default: AWS_ENDPOINT_URL, else AWS).")
    s3_region: str = _opt("", "S3 region (default: AWS_REGION / AWS config, else us-east-1).")
    registry: str = _opt(
        "",
        "Checkpoint registry (a path or s3:// prefix) that registry:NAME refers to (default: $BIGCLIP_REGISTRY).",
    )

    def validate(self) -> None:
        if min(self.save_frequency, self.save_every_n_steps, self.keep_last, self.remote_keep_last) < 0:
            raise ConfigError("checkpoint frequencies and retention counts must not be negative")


@dataclass
class LogConfig:
    logs: str = _opt("./logs", "Root folder for run directories.")
    name: str = _opt("", "Run name (default: date-model-lr-batch-precision).")
    log_every_n_steps: int = _opt(100, "Print a log line and write scalars every N steps.")
    report_to: str = _opt(
        "tensorboard", "Metric sinks: 'tensorboard' or '' for none.", choices=("tensorboard", "")
    )
    remote_sync: str = _opt("", "Copy the run directory to this URI in the background (e.g. s3://b/runs).")
    remote_sync_frequency: int = _opt(300, "Seconds between remote syncs.")
    remote_sync_protocol: str = _opt("s3", "How to reach --remote-sync.", choices=("s3", "fsspec"))
    batch_keys_file: str = _opt(
        "", "Append each step's sample keys to FILE.rankN.jsonl, to audit data order."
    )

    def validate(self) -> None:
        if self.log_every_n_steps < 1:
            raise ConfigError(f"--log-every-n-steps must be at least 1, got {self.log_every_n_steps}")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self) -> TrainConfig:
        for section in self.sections().values():
            section.validate()
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> TrainConfig:
        cfg = cls()
        for name, section in cfg.sections().items():
            for key, value in values.get(name, {}).items():
                setattr(section, key, value)
        return cfg


def section_of(field_name: str) -> str:
    """Which TrainConfig section holds a (flat) field name."""
    for section in dataclasses.fields(TrainConfig):
        if field_name in {f.name for f in dataclasses.fields(section.default_factory)}:
            return section.name
    raise KeyError(field_name)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for an optimizer step: linear warmup, then cosine to 0 (or constant)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_scheduler == "const":
        return cfg.lr
    decay_steps = max(1, total_steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / decay_steps)
    return 0.5 * (1 + math.cos(math.pi * progress)) * cfg.lr
