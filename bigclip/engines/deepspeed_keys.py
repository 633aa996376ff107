"""Where every DeepSpeed config key belongs, checked before the model is built.

DeepSpeed reads most top-level keys with a plain `dict.get`, so a misplaced key (a `stage3_*`
option at the top level, a typo) is silently ignored; sections it validates with pydantic only
fail once the model is already built. Both are checked here, with a message saying where a key
belongs. The section field names come from DeepSpeed's own pydantic models.
"""

from __future__ import annotations

from typing import Any

from bigclip.errors import ConfigError

# Top-level keys DeepSpeed 0.19 reads. Anything else would be ignored without a word.
# fmt: off
TOP_LEVEL_KEYS = frozenset((
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation", "optimizer", "scheduler", "fp16", "bf16", "bfloat16",
    "torch_autocast", "data_types", "gradient_clipping", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "communication_data_type",
    "seq_parallel_communication_data_type", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "activation_checkpointing", "flops_profiler", "comms_logger",
    "tensorboard", "wandb", "csv_monitor", "comet", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "dump_state", "disable_allgather", "disable_python_gc", "dataloader_drop_last",
    "checkpoint", "aio", "autotuning", "data_efficiency", "curriculum_learning", "weight_quantization",
    "compile", "timers", "tensor_parallel", "expert_parallel", "hybrid_engine", "pipeline",
    "datastates_ckpt", "log_level", "use_data_before_expert_parallelism",
))
# fmt: on
OPTIMIZER_PARAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def check_placement(raw: dict[str, Any], *, path: str) -> None:
    """Refuse keys DeepSpeed would ignore, saying which section they belong in."""
    sections = section_keys()
    for key in raw:
        if key in TOP_LEVEL_KEYS:
            continue
        homes = [name for name, keys in sections.items() if key in keys]
        if homes:
            raise ConfigError(
                f'{path}: "{key}" is a {" / ".join(homes)} option, not a top-level one; DeepSpeed '
                f'would ignore it here. Move it into "{homes[0]}".'
            )
        removed = _removed_keys().get(key)
        hint = removed or "it is not a DeepSpeed option and would be ignored; check the spelling"
        raise ConfigError(f'{path}: unknown top-level key "{key}": {hint}')
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f'{path}: "zero_optimization" must be an object, e.g. {{"stage": 3}}')
    for key in zero:
        if key not in sections["zero_optimization"]:
            offload = [n for n in ("offload_optimizer", "offload_param") if key in sections[n]]
            where = f'"zero_optimization.{offload[0]}"' if offload else "the DeepSpeed docs"
            raise ConfigError(f'{path}: "zero_optimization.{key}" is not a ZeRO option; see {where}')


def section_keys() -> dict[str, set[str]]:
    """Field names (and aliases) of the sections DeepSpeed validates, from its own pydantic models."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    def names(model: type) -> set[str]:
        return {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}

    return {
        "zero_optimization": names(DeepSpeedZeroConfig),
        "offload_optimizer": names(DeepSpeedZeroOffloadOptimizerConfig),
        "offload_param": names(DeepSpeedZeroOffloadParamConfig),
        "fp16": names(DeepSpeedFP16Config),
        "bf16": names(DeepSpeedBF16Config),
        "optimizer.params": set(OPTIMIZER_PARAM_KEYS),
    }


def _removed_keys() -> dict[str, str]:
    from deepspeed.runtime import config as ds_config

    return getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})


def validate_with_deepspeed(section: dict, name: str, *, path: str) -> None:
    """DeepSpeed's own (pydantic) checks of a section, now rather than after the model is built."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    model = {
        "zero_optimization": DeepSpeedZeroConfig,
        "fp16": DeepSpeedFP16Config,
        "bf16": DeepSpeedBF16Config,
    }
    try:
        model[name](**section)
    except ValidationError as e:
        raise ConfigError(f'{path}: invalid "{name}": {e}') from None
