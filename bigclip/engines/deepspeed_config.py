"""DeepSpeed JSON configs: load, check where every key sits, fill "auto" from bigclip's flags.

bigclip's flags are the one source of truth for what both engines share: batch sizes,
precision, gradient clipping and the optimizer's hyperparameters. A ds_config may leave those
out or set them to "auto" (they are filled in); an explicit value that contradicts a flag is a
`ConfigError` naming both values. Everything DeepSpeed-specific (ZeRO stage, offload, buckets,
overlap) comes from the file. All of this runs before the model is built.

Misplaced and misspelt keys are refused up front (see deepspeed_keys.py).

How flags map onto DeepSpeed:
  --batch-size      train_micro_batch_size_per_gpu
  --accum-freq      bigclip accumulates itself (features cached across micro-batches, OpenCLIP
                    semantics), so DeepSpeed always gets gradient_accumulation_steps = 1 and
                    train_batch_size = batch-size x world; in the file, gradient_accumulation_steps
                    and train_batch_size mean bigclip's --accum-freq and global batch.
  --precision       fp32: no fp16/bf16 section; amp_bf16: bf16 with fp32 master weights;
                    amp: fp16 with dynamic loss scaling; pure_bf16: bf16 master weights and
                    optimizer states (bf16_master_weights_and_grads, bf16_optimizer_states)
  --grad-clip-norm  gradient_clipping
  --optimizer       a client optimizer built by bigclip, unless the file has an "optimizer"
                    section (type AdamW), whose params are filled from --lr/--beta1/--beta2/--eps/--wd:
                    DeepSpeed then builds its own (DeepSpeedCPUAdam under optimizer offload).
  --lr-scheduler    bigclip sets the learning rate every step: a "scheduler" section is refused.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from bigclip.config import PRECISION_KINDS, TrainConfig
from bigclip.engines.deepspeed_keys import check_placement, validate_with_deepspeed
from bigclip.errors import ConfigError

DS_INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"
SHIPPED = Path(__file__).with_name("ds_configs")  # package data; the checkout's ds_configs/ links here
AUTO = "auto"

# zero_optimization keys whose "auto" is filled from the model width (the Hugging Face convention).
WIDTH_AUTO = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
FP16_DEFAULTS = {  # the same dynamic loss scaling as bigclip's DynamicLossScaler (FSDP2)
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 2000,
    "hysteresis": 1,
    "min_loss_scale": 1,
}


@dataclass(frozen=True)
class DeepSpeedPlan:
    """A resolved config and the facts the engine needs from it."""

    config: dict[str, Any]  # what deepspeed.initialize receives
    stage: int
    deepspeed_builds_optimizer: bool  # an "optimizer" section: DeepSpeed makes it from model groups
    offload_optimizer: bool
    offload_param: bool
    path: str


@dataclass(frozen=True)
class ZeroSettings:
    """The DeepSpeed knobs that change memory (element counts, as DeepSpeed reads them): what the
    planner prices a ZeRO run by."""

    reduce_bucket_size: int = 0
    prefetch_bucket_size: int = 0
    persistence_threshold: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False

    @classmethod
    def of(cls, plan: DeepSpeedPlan) -> ZeroSettings:
        z = plan.config["zero_optimization"]
        return cls(
            reduce_bucket_size=int(z.get("reduce_bucket_size", 5e8)),
            prefetch_bucket_size=int(z.get("stage3_prefetch_bucket_size", 5e7)),
            persistence_threshold=int(z.get("stage3_param_persistence_threshold", 1e5)),
            offload_optimizer=plan.offload_optimizer,
            offload_param=plan.offload_param,
        )


def import_deepspeed() -> ModuleType:
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(
            f"--engine deepspeed needs DeepSpeed, which cannot be imported ({e}). Install it after "
            f"torch with: {DS_INSTALL}  (or use --engine fsdp)"
        ) from e
    return deepspeed


def shipped_ds_configs() -> list[str]:
    """The names of the configs bigclip ships (package data, also the checkout's ds_configs/)."""
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def find_ds_config(value: str) -> Path:
    """A path to a JSON file, or the name of a shipped config: `zero3`, `zero3.json`, or
    `ds_configs/zero3.json` from any working directory (the README's spelling, outside a checkout)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    if not path.is_absolute() and path.parent in (Path("."), Path("ds_configs")):
        shipped = SHIPPED / (path.name if path.suffix == ".json" else f"{path.name}.json")
        if shipped.is_file():
            return shipped
    raise ConfigError(
        f"--deepspeed-config {value}: file not found; give a path to a DeepSpeed JSON config or the "
        f"name of one bigclip ships: {', '.join(shipped_ds_configs())}"
    )


def load_ds_config(path: str) -> dict[str, Any]:
    found = find_ds_config(path)
    try:
        raw = json.loads(found.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--deepspeed-config {path}: expected a JSON object at the top level")
    return raw


def resolve_ds_config(
    raw: dict[str, Any],
    cfg: TrainConfig,
    *,
    world_size: int,
    model_width: int | None,
    path: str = "ds_config",
) -> DeepSpeedPlan:
    """Check placement, fill "auto" from flags, refuse contradictions; returns what DeepSpeed gets.
    `model_width` None: check everything but leave the "auto" sizes that follow the model's width
    (the engine checks its config when made, before any model, and fills them at `build`)."""
    check_placement(raw, path=path)
    out = copy.deepcopy(raw)
    if "bfloat16" in out:  # DeepSpeed's legacy spelling of "bf16"
        out.setdefault("bf16", out.pop("bfloat16"))
    _resolve_batch(out, cfg, world_size=world_size, path=path)
    _resolve_precision(out, cfg.engine.precision, path=path)
    _settle(out, "gradient_clipping", cfg.optim.grad_clip_norm, flag="--grad-clip-norm", path=path)
    stage, offload_optimizer, offload_param = _resolve_zero(out, model_width=model_width, path=path)
    _resolve_linear(out["zero_optimization"], torchcompile=cfg.model.torchcompile, path=path)
    ds_optimizer = _resolve_optimizer(out, cfg, offload=offload_optimizer, path=path)
    if "scheduler" in out:
        raise ConfigError(
            f'{path}: remove "scheduler": bigclip sets the learning rate every step from --lr, '
            "--warmup and --lr-scheduler"
        )
    if out.get("managed_gradient_accumulation", True) is not True:
        raise ConfigError(f'{path}: remove "managed_gradient_accumulation": bigclip drives accumulation')
    out.setdefault("steps_per_print", 2**31 - 1)  # bigclip logs progress itself
    return DeepSpeedPlan(
        config=out,
        stage=stage,
        deepspeed_builds_optimizer=ds_optimizer,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        path=path,
    )


def _same(have: Any, want: Any) -> bool:
    if isinstance(want, (tuple, list)):
        return isinstance(have, (tuple, list)) and list(map(float, have)) == list(map(float, want))
    if isinstance(want, bool) or isinstance(have, bool):
        return have is want
    try:
        return float(have) == float(want)
    except (TypeError, ValueError):
        return False


def _settle(section: dict, key: str, want: Any, *, flag: str, path: str, where: str = "") -> None:
    """Fill a missing or "auto" value from a flag; an explicit different value is an error."""
    have = section.get(key, AUTO)
    if have != AUTO and not _same(have, want):
        raise ConfigError(
            f'{path}: "{where}{key}": {json.dumps(have)} contradicts {flag} ({want}). Set it to "auto" '
            f"(bigclip fills it from the flag) or change {flag}."
        )
    section[key] = list(want) if isinstance(want, tuple) else want


def _resolve_batch(out: dict, cfg: TrainConfig, *, world_size: int, path: str) -> None:
    b, k = cfg.data.batch_size, cfg.optim.accum_freq
    _settle(out, "train_micro_batch_size_per_gpu", b, flag="--batch-size", path=path)
    _settle(out, "gradient_accumulation_steps", k, flag="--accum-freq", path=path)
    global_batch = b * k * world_size
    _settle(
        out,
        "train_batch_size",
        global_batch,
        flag=f"--batch-size x --accum-freq x world size ({b} x {k} x {world_size})",
        path=path,
    )
    # bigclip accumulates itself (see the module docstring): DeepSpeed sees one micro-batch per step.
    out["gradient_accumulation_steps"] = 1
    out["train_batch_size"] = b * world_size


def _resolve_precision(out: dict, precision: str, *, path: str) -> None:
    flag = f"--precision {precision}"
    if out.get("torch_autocast", {}).get("enabled", False):
        raise ConfigError(f'{path}: "torch_autocast" is set by {flag}; remove it')
    kind = PRECISION_KINDS[precision]
    fp16, bf16 = out.setdefault("fp16", {}), out.setdefault("bf16", {})
    _settle(fp16, "enabled", kind.deepspeed == "fp16", flag=flag, path=path, where="fp16.")
    _settle(bf16, "enabled", kind.deepspeed == "bf16", flag=flag, path=path, where="bf16.")
    if fp16["enabled"]:
        for key, value in FP16_DEFAULTS.items():
            fp16.setdefault(key, value)
    if bf16["enabled"]:
        pure = kind.params == "bfloat16"  # bf16 masters and optimizer state
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            _settle(bf16, key, pure, flag=flag, path=path, where="bf16.")
        # DeepSpeed's default (true) reads an overflow flag and the norm's validity on the host
        # every step (ZeRO-1/2: 3 syncs). bf16 has fp32's range; like the FSDP2 engine, bigclip
        # leaves non-finite values to the loss's checks at log steps. A config may still set it.
        bf16.setdefault("check_grad_overflow", False)
    validate_with_deepspeed(fp16, "fp16", path=path)
    validate_with_deepspeed(bf16, "bf16", path=path)


def _resolve_zero(out: dict, *, model_width: int | None, path: str) -> tuple[int, bool, bool]:
    """The ZeRO stage, and whether it offloads the optimizer state and the parameters."""
    zero = out.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise ConfigError(
            f'{path}: "zero_optimization.stage" must be 1, 2 or 3 (got {stage!r}); for plain data '
            "parallelism use --engine fsdp"
        )
    for key, value in list(zero.items()):
        if value == AUTO:
            if key not in WIDTH_AUTO:
                raise ConfigError(f'{path}: "auto" is not understood for "zero_optimization.{key}"')
            if model_width is not None:
                zero[key] = WIDTH_AUTO[key](model_width)
    offload_optimizer = _offloaded(zero, "offload_optimizer", stage=stage, path=path)
    offload_param = _offloaded(zero, "offload_param", stage=stage, path=path)
    validate_with_deepspeed({k: v for k, v in zero.items() if v != AUTO}, "zero_optimization", path=path)
    return stage, offload_optimizer, offload_param


def _resolve_linear(zero: dict, *, torchcompile: bool, path: str) -> None:
    """--torchcompile turns off ZeRO-3's "memory_efficient_linear" (DeepSpeed's default: on).

    That option makes `zero.Init` replace torch.nn.functional.linear, process-wide and for good,
    with an autograd.Function whose forward adds the bias in place (`output += bias`). torch
    2.11's dynamo traces such a Function wrongly (pytorch/pytorch#180642): the compiled block's
    backward routes the gradient to the wrong output, so every block parameter gets a zero
    gradient and the input only its residual path's; the run trains, silently wrong. Under
    compile the option buys nothing anyway: AOTAutograd, not the Function, picks what backward saves.
    """
    if not torchcompile:
        return
    if zero.get("memory_efficient_linear", False) is not False:
        raise ConfigError(
            f'{path}: "zero_optimization.memory_efficient_linear": true cannot be combined with '
            "--torchcompile (its linear trains wrong once compiled with torch 2.11); remove the key "
            "(bigclip sets it to false) or drop --torchcompile"
        )
    zero["memory_efficient_linear"] = False


def _offloaded(zero: dict, name: str, *, stage: int, path: str) -> bool:
    section = zero.get(name)
    if not section or section.get("device", "none") == "none":
        return False
    if float(section.get("ratio", 1.0)) != 1.0:
        raise ConfigError(
            f'{path}: partial optimizer offload ("zero_optimization.{name}.ratio") is not supported by '
            "bigclip's checkpoints; remove it"
        )
    if section["device"] == "nvme":
        raise ConfigError(
            f'{path}: "zero_optimization.{name}.device": "nvme" is not supported by bigclip (its '
            'checkpoints read partitions in memory); use "cpu"'
        )
    if name == "offload_param" and stage != 3:
        raise ConfigError(f'{path}: "zero_optimization.offload_param" needs "stage": 3 (got {stage})')
    return True


def _resolve_optimizer(out: dict, cfg: TrainConfig, *, offload: bool, path: str) -> bool:
    """True when DeepSpeed builds the optimizer from the file's (filled-in) "optimizer" section."""
    section = out.get("optimizer")
    if section is None:
        if cfg.optim.optimizer == "adamw8bit":
            # bitsandbytes' AdamW8bit is not on DeepSpeed's list of ZeRO-tested optimizers; it only
            # sees flat fp32 partitions, which it handles like any other parameter.
            out["zero_allow_untested_optimizer"] = True
        if offload:
            # The client optimizer steps on the CPU partitions; DeepSpeed refuses that by default,
            # fearing a slow step, but torch's fused AdamW is as fast as DeepSpeedCPUAdam there
            # (benchmarks/optimizer_step.py) and needs no compile at start-up.
            if out.get("zero_force_ds_cpu_optimizer", False):
                raise ConfigError(
                    f'{path}: "zero_force_ds_cpu_optimizer" needs an "optimizer" section, e.g. '
                    '{"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", '
                    '"weight_decay": "auto"}}'
                )
            out["zero_force_ds_cpu_optimizer"] = False
        return False
    if cfg.optim.opt_kwargs:
        raise ConfigError(
            f'{path}: its "optimizer" section is built by DeepSpeed, which --opt-kwargs {cfg.optim.opt_kwargs} '
            'cannot reach: put them in the section\'s "params", or remove the section (bigclip then builds '
            "the optimizer with them)"
        )
    if cfg.optim.optimizer != "adamw":
        raise ConfigError(
            f"{path}: --optimizer {cfg.optim.optimizer} is built by bigclip and handed to DeepSpeed; remove "
            'the "optimizer" section (or use --optimizer adamw)'
        )
    if str(section.get("type", "")).lower() != "adamw":
        raise ConfigError(
            f'{path}: "optimizer.type": {json.dumps(section.get("type"))} contradicts --optimizer adamw; '
            'use "AdamW"'
        )
    params = section.setdefault("params", {})
    if params == AUTO:
        params = section["params"] = {}
    o = cfg.optim
    wanted = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.wd}
    flags = {"lr": "--lr", "betas": "--beta1/--beta2", "eps": "--eps", "weight_decay": "--wd"}
    for key, value in wanted.items():
        _settle(params, key, value, flag=flags[key], path=path, where="optimizer.params.")
    return True
