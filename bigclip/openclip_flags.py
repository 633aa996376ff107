"""OpenCLIP trainer options that bigclip ignores or refuses, and OpenCLIP spellings converted to bigclip's.

Every option of `open_clip_train.params` is either a field of the config dataclasses
(`bigclip/config/`, same name and meaning) or listed here, saying why it does not apply or why
bigclip refuses it and what to use instead; `tests/test_openclip_flags.py` walks OpenCLIP's
parser to keep it so. Listed flags are declared in the parser like any other (`--help` leaves them
out, `--help-openclip` lists them with their reasons).

The rule between the two lists: an option is IGNORED (one warning, then the run goes on as if it
were not given) when leaving it out changes neither what is trained nor what is evaluated or
saved: hints to machinery bigclip does not have (DDP, BatchNorm, TorchScript, timm optimizers,
CoCa's loss, log display). It is REFUSED, failing while the command line is parsed (exit code 2,
before anything is built), when ignoring it would silently change the results: other launchers
(Horovod), other weights (--pretrained-image), another loss or model layout (distillation, CoCa
models, NaFlex, custom text), other data (CSV, JSON captions, --max-image-pixels), another
optimization (layer decay, --wd-exclude) or a memory plan the run relies on (--fsdp-offload-cpu).

Six kinds of entry:
  IGNORED         flags that do not apply to bigclip's runs: warned about once, then ignored
  REFUSED         flags whose ignoring would change results (DDP/Horovod launch, distillation...)
  REFUSED_VALUES  values of accepted flags that bigclip does not implement (--precision bf16)
  VALUE_ALIASES   OpenCLIP's other spelling of a bigclip value (--precision amp_bfloat16)
  FLAG_ALIASES    other flag names of a bigclip field, each with its converter (`--use-bnb-linear`,
                  `--opt`, `--loss-dist-impl`; DeepSpeed's `--deepspeed_config`, `--local_rank`)
  SWITCHES        OpenCLIP flags without a value that set one value of a field (`--fsdp`)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from bigclip.errors import ConfigError

_DDP = "bigclip shards with FSDP2 or DeepSpeed ZeRO over torch.distributed; DDP options do not apply"
_CSV = (
    "bigclip reads webdataset shards only (local or s3://); convert a CSV dataset with img2dataset "
    "(--output_format webdataset) and pass the shards as --train-data"
)
_COCA = "bigclip trains contrastive CLIP and SigLIP models; CoCa's captioning loss is not built"
_DISTILL = "bigclip has no distillation; train with --pretrained to start from a teacher's weights instead"

_AUDIO = "bigclip trains image-text CLIP and SigLIP models; OpenCLIP main's audio towers (CLAP) are not built"
_NAFLEX = (
    "NaFlex (variable resolution and aspect ratio, packed patch sequences) needs timm's NaFlexViT towers and a "
    "packing loader; bigclip builds OpenCLIP's fixed-resolution ViT towers: train at one size (--force-image-size)"
)
_BUCKETS = (
    "length bucketing groups variable-length NaFlex samples; bigclip's batches have one image size and one "
    "context length, so there is nothing to bucket"
)
_LAYER_DECAY = (
    "layer-wise learning-rate decay is not implemented; to keep a pretrained tower's early layers, freeze them "
    "with --lock-image/--lock-text and --lock-image-unlocked-groups/--lock-text-unlocked-layers"
)
_JSON_TEXT = (
    "captions come from a text member, chosen with --text-key (e.g. --text-key caption.txt;txt); write the JSON "
    "field into such a member when making the shards"
)

# flag -> why it is refused and what to use instead (OpenCLIP 3.3.0's options and main's newer ones)
REFUSED: dict[str, str] = {
    "--horovod": f"{_DDP}; launch with torchrun, srun or the deepspeed launcher",
    "--pretrained-image": (
        "it loads timm ImageNet weights into timm image towers; bigclip builds OpenCLIP's ViT towers: "
        "use --pretrained with CLIP weights"
    ),
    "--force-custom-text": (
        "CustomTextCLIP (text tower under text.*) exists for Hugging Face text towers, which bigclip does "
        "not build; bigclip's models use CLIP's layout, which OpenCLIP loads as it is"
    ),
    "--trace": (
        "torch.jit.trace makes an inference-only model; bigclip trains: use --torchcompile for speed, and "
        "`bigclip consolidate` for weights to trace elsewhere"
    ),
    "--distill-model": _DISTILL,
    "--distill-pretrained": _DISTILL,
    # OpenCLIP main (tests/data/openclip_main_params.json names the commit)
    **dict.fromkeys(
        (
            "--audio-ext",
            "--audio-fill",
            "--audio-fusion",
            "--audio-int16-normalize",
            "--audio-layer-decay",
            "--audio-multiprocessing-context",
            "--audio-trunc",
            "--audio-zeroshot-audio-key",
            "--audio-zeroshot-class-key",
            "--audio-zeroshot-dataset",
            "--audio-zeroshot-multiprocessing-context",
            "--audio-zeroshot-split",
            "--audio-zeroshot-target-key",
            "--audio-zeroshot-template",
            "--audio-zeroshot-workers",
            "--pretrained-audio",
        ),
        _AUDIO,
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "--use-naflex",
            "--force-naflex-vision",
            "--naflex-batch-divisor",
            "--naflex-loss-scale",
            "--naflex-max-text-tokens",
            "--naflex-max-tokens-per-batch",
            "--naflex-num-train-image-tokens",
            "--naflex-pad-multiple",
            "--naflex-patch-size-probs",
            "--naflex-patch-sizes",
            "--naflex-seq-len-probs",
            "--naflex-seq-lens",
            "--text-pad-multiple",
        ),
        _NAFLEX,
    ),  # fmt: skip
    **dict.fromkeys(
        ("--length-bucketing", "--bucket-chunk", "--bucket-pool", "--bucket-prefetch-pools"), _BUCKETS
    ),
    **dict.fromkeys(("--image-layer-decay", "--visual-layer-decay", "--text-layer-decay"), _LAYER_DECAY),
    "--json-text-key": _JSON_TEXT,
    "--json-text-key-probs": _JSON_TEXT,
    "--fsdp-offload-cpu": (
        "FSDP2 CPU offload is not wired in; for optimizer or parameter offload use --engine deepspeed with a "
        "ds_config that has offload_optimizer/offload_param (see ds_configs/)"
    ),
    "--max-image-pixels": (
        "bigclip opens images header-first and decodes JPEGs at reduced size; images PIL refuses as decompression "
        "bombs are skipped and counted; to drop large images by area, filter when making the shards "
        "(img2dataset --max_image_area)"
    ),
    "--wd-exclude": (
        "bigclip's weight-decay rule is OpenCLIP's default one, fixed (no decay for parameters of fewer than 2 "
        "dimensions or with bn, ln, bias or logit_scale in their name); extra patterns are not supported"
    ),
}

# flag -> why it does not apply (what a user relying on it should know); see the module docstring.
_NO_BATCHNORM = "bigclip builds ViT towers, which have no BatchNorm"
IGNORED: dict[str, str] = {
    "--ddp-static-graph": f"{_DDP} (FSDP2 per-block sharding needs no static-graph hint)",
    "--use-bn-sync": f"{_NO_BATCHNORM} to synchronise",
    "--lock-image-freeze-bn-stats": (
        f"{_NO_BATCHNORM} statistics to freeze (their LayerNorms freeze with --lock-image)"
    ),
    **dict.fromkeys(
        ("--csv-separator", "--csv-img-key", "--csv-caption-key"),
        "it is read only with --dataset-type csv, which bigclip refuses (it reads webdataset shards, as "
        "OpenCLIP does when these are given with webdataset data)",
    ),
    "--momentum": "it is passed only to timm optimizers (--opt timm/...); bigclip's AdamW has no momentum option",
    "--torchscript": (
        "TorchScript compiles the same computation; bigclip trains eager (or --torchcompile for speed), "
        "with the same results"
    ),
    "--copy-codebase": (
        "bigclip runs as an installed package, not from a source tree; the run's resolved options are "
        "saved as config.yaml in the run folder (pin the version with pip install bigclip==X)"
    ),
    **dict.fromkeys(
        ("--coca-caption-loss-weight", "--coca-contrastive-loss-weight"),
        f"they weight CoCa's losses, read only for CoCa models: {_COCA}",
    ),
    "--text-pooler-own-group": "it places the text pooler in a layer-decay group, and bigclip has no layer decay",
    "--fsdp-checkpoint": (
        "bigclip always saves sharded (torch.distributed.checkpoint) checkpoints, which resume at any world "
        "size; `bigclip consolidate` writes the full weights as safetensors"
    ),
    "--opt-fallback-list": (
        "it routes parameters to the AdamW fallback of Muon-family timm optimizers; bigclip's optimizer is "
        "AdamW for every parameter"
    ),
    "--torchcompile-strategy": (
        "bigclip compiles each residual block before sharding (--torchcompile), one strategy for both "
        "engines, with the same results; tune it with --torchcompile-mode and --torchcompile-backend"
    ),
    "--train-loss-ema-samples": (
        "it smooths the loss shown in the log line; bigclip's line shows the running average of the logged "
        "global losses since the epoch began (as OpenCLIP 3.3.0), and the per-step loss is in the scalars"
    ),
}

_LOW_PRECISION_WEIGHTS = (
    "OpenCLIP's --precision {value} keeps the matmul weights in {dtype} with no fp32 master copy, "
    "which bigclip does not implement; use --precision {use} ({why})"
)
# field name -> {value: why refused and what to use instead}
REFUSED_VALUES: dict[str, dict[str, str]] = {
    "precision": {
        "bf16": _LOW_PRECISION_WEIGHTS.format(
            value="bf16",
            dtype="bf16",
            use="amp_bf16 or pure_bf16",
            why="amp_bf16: bf16 compute with fp32 master weights; pure_bf16: every weight in bf16",
        ),
        "fp16": _LOW_PRECISION_WEIGHTS.format(
            value="fp16", dtype="fp16", use="amp", why="fp16 compute, fp32 master weights, loss scaling"
        ),
        "pure_fp16": (
            "fp16 weights without loss scaling or master weights underflow in training; use --precision "
            "amp (fp16 compute with loss scaling) or pure_bf16 (every weight in bf16)"
        ),
    },
    "dataset_type": {
        "csv": _CSV,
        "webdataset-audio": _AUDIO,
        "synthetic-audio": _AUDIO,
        "synthetic": (
            "bigclip reads webdataset shards only; `bigclip make-demo-data DIR` writes synthetic "
            "captioned-image shards to train on"
        ),
    },
    # Not OpenCLIP's: bigclip's own former default, renamed when OpenCLIP's BPE became the default.
    "tokenizer": {
        "simple": (
            "this was bigclip's word-hashing tokenizer, now named 'hashing' (opt-in: its ids mean nothing "
            "to OpenCLIP weights); OpenCLIP's BPE tokenizer (its SimpleTokenizer) is 'open_clip', the default"
        )
    },
}

# field name -> {OpenCLIP value: bigclip value}
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "precision": {"amp_bfloat16": "amp_bf16"},
    "dataset_type": {"auto": "webdataset"},  # OpenCLIP's 'auto' picks webdataset for .tar shards
}


def accepted_spellings(field_name: str) -> tuple[str, ...]:
    """Values the parser lets through for a field besides its own choices (then resolved)."""
    return (*VALUE_ALIASES.get(field_name, {}), *REFUSED_VALUES.get(field_name, {}))


def resolve_value(field_name: str, value: Any) -> Any:
    """A field's value with OpenCLIP's aliases converted; a refused value raises, saying why."""
    if not isinstance(value, str):
        return value
    refused = REFUSED_VALUES.get(field_name, {})
    if value in refused:
        raise ConfigError(f"--{field_name.replace('_', '-')} {value}: {refused[value]}")
    return VALUE_ALIASES.get(field_name, {}).get(value, value)


def refusal(flag: str) -> str:
    return f"{flag} is an OpenCLIP option bigclip does not take: {REFUSED[flag]}"


def ignored_warning(flag: str) -> str:
    return f"{flag} is an OpenCLIP option that does not apply to bigclip, ignored: {IGNORED[flag]}"


_warned: set[str] = set()


def warn_ignored(flag: str) -> None:
    """Say once per process, on stderr, that `flag` is ignored; under a launcher, rank 0 alone
    says it (every rank parses the same command line). Before logging starts, so also for
    `bigclip slurm` and `bigclip plan`, which then leave the flag out of what they render."""
    if flag in _warned or _launcher_rank() != 0:
        return
    _warned.add(flag)
    print(f"bigclip: warning: {ignored_warning(flag)}", file=sys.stderr, flush=True)


def _launcher_rank() -> int:
    """This process's rank as torchrun/deepspeed (RANK) or srun (SLURM_PROCID) set it; 0 without one.
    (bigclip.distributed reads the same variables, but imports torch.)"""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 0


# OpenCLIP's `--use-bnb-linear` class names, mapped onto SwitchBack `--linear-kind`s.
_BNB_LINEAR_ALIASES = {
    "SwitchBackLinearGlobal": "switchback-global",
    "SwitchBackLinearGlobalMemEfficient": "switchback-memefficient",
    "SwitchBackLinearVectorwise": "switchback-vectorwise",
}


def bnb_linear_to_int8(value: str) -> str:
    if value not in _BNB_LINEAR_ALIASES:
        raise ConfigError(
            f"--use-bnb-linear {value!r} is not supported; use one of {sorted(_BNB_LINEAR_ALIASES)} "
            "or --int8 {switchback-global,switchback-vectorwise,switchback-memefficient}, "
            "or --linear-kind for the other kinds"
        )
    return _BNB_LINEAR_ALIASES[value]


def opt_to_optimizer(value: str) -> str:
    """OpenCLIP's `--opt`: 'adamw' or 'timm/NAME'; bigclip has AdamW and 8-bit AdamW."""
    if value in ("adamw", "adamw8bit"):
        return value
    raise ConfigError(
        f"--opt {value}: bigclip's optimizers are torch AdamW (--opt adamw) and bitsandbytes' 8-bit AdamW "
        "(--optimizer adamw8bit); timm optimizers are not supported"
    )


# OpenCLIP's SigLIP exchange implementations, all giving the same loss, by communication pattern.
_LOSS_DIST_IMPL = {"bidir": "ring", "shift": "ring", "gather": "allgather", "reduce": "allgather"}


def loss_dist_impl_to_exchange(value: str) -> str:
    if value not in _LOSS_DIST_IMPL:
        raise ConfigError(
            f"--loss-dist-impl {value!r}: use one of {', '.join(_LOSS_DIST_IMPL)} (bidir/shift pass features "
            "between neighbours: bigclip's --loss-exchange ring; gather/reduce: --loss-exchange allgather)"
        )
    return _LOSS_DIST_IMPL[value]


def int8_or_bnb_to_kind(value: str) -> str:
    """`--int8 MODE` (a SwitchBack kind, checked against --linear-kind's choices) or OpenCLIP's
    `--use-bnb-linear CLASS` (a bitsandbytes class name, converted or refused)."""
    return value if value.startswith("switchback-") else bnb_linear_to_int8(value)


# Every other spelling of a bigclip flag, by field: flags that take the value in their own
# spelling (converted by the function; the field's own checks then apply), and switches without a
# value that set one value of the field. cli_args declares them beside the field's flag and
# cli_help lists them.
FLAG_ALIASES: dict[str, tuple[tuple[str, ...], Callable[[str], Any]]] = {
    "linear_kind": (("--int8", "--use-bnb-linear"), int8_or_bnb_to_kind),
    "optimizer": (("--opt",), opt_to_optimizer),
    "loss_exchange": (("--loss-dist-impl",), loss_dist_impl_to_exchange),  # bidir/shift, gather/reduce
    "deepspeed_config": (("--deepspeed_config",), str),  # DeepSpeed's own (deepspeed.add_config_arguments)
    "local_rank": (("--local_rank",), int),  # what the deepspeed launcher passes (--local_rank=N)
}
SWITCHES: dict[str, dict[str, Any]] = {
    "engine": {"--fsdp": "fsdp"},  # OpenCLIP main's FSDP2 is bigclip's default engine
    "reshard_after_forward": {"--fsdp-no-reshard-after-forward": False},
}
