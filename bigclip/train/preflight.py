"""What a training run checks before any work: before a process group is formed, a model built or
data read, so a bad input costs a second and loses nothing.

`check_flags` needs the flags only and imports no torch: `bigclip train` runs it before importing
torch, so a contradiction fails in well under a second. `check_machine` asks the machine (torch's
devices, DeepSpeed's accelerator) and the launcher's environment (world size), still before the
process group. The checks that need data (shards, sizes.json) or a checkpoint's manifest stay with
the data and checkpoint code; each section's own value checks are its `validate`.
"""

from __future__ import annotations

import os

from bigclip.config import EngineConfig, TrainConfig
from bigclip.config.linear_kinds import linear_kind
from bigclip.errors import ConfigError
from bigclip.models.hf_hub import HF_HUB_PREFIX
from bigclip.rank_env import read_launch_env


def check_flags(cfg: TrainConfig) -> None:
    """Checks a run needs beyond `TrainConfig.validate` (which `bigclip plan`/`slurm` share), with
    the world size the launcher's environment declares."""
    if cfg.evaluates_only:
        check_evaluation_only(cfg)
    elif not cfg.data.train_data.strip():
        raise ConfigError(
            "--train-data is empty; give a shard pattern such as /data/{00000..00099}.tar (or, to evaluate "
            "weights without training, --val-data, --imagenet-val or --imagenet-v2 with --pretrained or --resume)"
        )
    _check_tag_tokenizer(cfg)
    _check_global_batch(cfg, world_size=launch_world_size())


def check_evaluation_only(cfg: TrainConfig) -> None:
    """A run without --train-data evaluates weights (OpenCLIP's way): it needs weights to evaluate
    and an evaluation that runs (a frequency of 0 turns one off, as in training)."""
    weights = cfg.model.pretrained or cfg.checkpoint.resume or cfg.model.model.startswith(HF_HUB_PREFIX)
    if not weights:
        raise ConfigError(
            "no --train-data: this run only evaluates, and has no weights to evaluate; give them with "
            "--pretrained FILE|TAG|URI or --resume PATH|latest (or add --train-data to train)"
        )
    sets = cfg.data.evaluation_sets()
    if not any(sets.values()):
        off = {"--val-frequency 0" if flag == "--val-data" else "--zeroshot-frequency 0" for flag in sets}
        frequencies = " and ".join(sorted(off, reverse=True))
        raise ConfigError(
            f"no --train-data and {frequencies}: {', '.join(sets)} would never be evaluated, so the run would do "
            "nothing; leave the frequency at its default (or any N > 0)"
        )


def launch_world_size(env: dict[str, str] | None = None) -> int:
    """The world size the launcher's environment declares, read as bigclip.distributed.launch_env
    reads it (both use rank_env.py; tests/test_bad_input_flags.py checks the two agree)."""
    return read_launch_env(dict(os.environ) if env is None else env)[1]


def _check_tag_tokenizer(cfg: TrainConfig) -> None:
    """OpenCLIP's pretrained tags were trained on its BPE ids (as data.check_tokenizer says later for
    weights whose metadata records a tokenizer)."""
    from bigclip.models.pretrained_tags import looks_like_tag

    tokenizer, allow = cfg.data.tokenizer, cfg.checkpoint.allow_tokenizer_change
    if looks_like_tag(cfg.model.pretrained) and tokenizer != "open_clip" and not allow:
        raise ConfigError(
            f"--pretrained {cfg.model.pretrained}: the weights were trained with --tokenizer open_clip, this run "
            f"has --tokenizer {tokenizer}; their text tower would read ids it never learned. Pass --tokenizer "
            "open_clip, or --allow-tokenizer-change to train on with the new ids"
        )


def check_machine(cfg: TrainConfig) -> None:
    """Checks that need torch (and DeepSpeed for its engine), but no process group."""
    check_device(cfg.engine)
    _check_linear_kind(cfg)
    if cfg.engine.engine == "deepspeed":
        _check_deepspeed(cfg, world_size=launch_world_size())


def check_device(engine: EngineConfig) -> None:
    """--device must name a device this machine has (else torch fails deep in set-up)."""
    import torch

    if not engine.device:
        return
    device = torch.device(engine.device)  # cpu, cuda or cuda:N (EngineConfig.validate)
    if device.type == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"--device {engine.device}: this machine has no GPU torch can use (torch.cuda.is_available() is "
            "False); leave --device out to train on the CPU, or run on a GPU node"
        )
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"--device {engine.device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}; "
            "leave --device out (cuda:LOCAL_RANK) or name one of them"
        )


def _check_global_batch(cfg: TrainConfig, *, world_size: int) -> None:
    b, k, n = cfg.data.batch_size, cfg.optim.accum_freq, cfg.data.train_num_samples
    per_step = b * k * world_size
    if n and n < per_step and not cfg.data.dataset_resampled:
        raise ConfigError(
            f"--train-num-samples {n} is less than one optimizer step's samples (--batch-size {b} x "
            f"--accum-freq {k} x {world_size} rank(s) = {per_step}): no step could run; lower --batch-size "
            "or --accum-freq, or give more samples"
        )


def _check_linear_kind(cfg: TrainConfig) -> None:
    """fp8 kinds need an fp8 GPU where the run computes on a GPU (a CPU emulates them)."""
    if linear_kind(cfg.model.linear_kind).family == "fp8":
        from bigclip.models.from_config import run_device_type
        from bigclip.ops.fp8.float8 import needs_emulation

        needs_emulation(run_device_type(cfg))  # one line on a GPU without fp8


def _check_deepspeed(cfg: TrainConfig, *, world_size: int) -> None:
    """The DeepSpeed config against the flags, and the precision against DeepSpeed's accelerator."""
    import torch

    from bigclip.engines.deepspeed_config import import_deepspeed, load_ds_config, resolve_ds_config
    from bigclip.models.named_configs import get_model_config

    model = get_model_config(cfg.model.model, cache_dir=cfg.model.cache_dir)
    width = max(model.vision_cfg.width, model.text_cfg.width)
    path = cfg.engine.deepspeed_config
    resolve_ds_config(load_ds_config(path), cfg, world_size=world_size, model_width=width, path=path)
    device = cfg.engine.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cpu"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as DeepSpeedEngine does on a CPU device
    import_deepspeed()  # a missing DeepSpeed: one line naming the package
    from deepspeed.accelerator import get_accelerator

    from bigclip.engines.deepspeed import check_supported

    check_supported(cfg, accelerator=get_accelerator())
