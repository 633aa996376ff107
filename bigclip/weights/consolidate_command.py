"""`bigclip consolidate SRC OUT`'s options, parsed and checked without torch, then the consolidation
(consolidate.py, which imports torch and the readers) only for options that hold.

Everything argv settles fails first, in a fraction of a second: unknown or missing options, OUT
against --open-clip-dir and --transformers-dir, sizes that do not read, --read-ahead below 1, and a local SRC that does
not exist. What only the source can say (its format, its manifest, its CRCs) is consolidate.py's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bigclip.cli_args import add_config_flags
from bigclip.config import CheckpointConfig
from bigclip.config.checkpoint import REGISTRY_SCHEME, registry_uri
from bigclip.errors import ConfigError, StorageError
from bigclip.storage.progress import human_bytes, parse_size
from bigclip.storage.schemes import is_local, local_path
from bigclip.storage.settings import configure_storage

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # consolidate.DTYPES' keys (tests/test_bad_input_commands.py)


def consolidate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigclip consolidate", description="Stream a sharded checkpoint "
                                     "into safetensors, tensor by tensor.")  # fmt: skip
    parser.add_argument("src", help="Checkpoint (path, s3:// URI, run checkpoint root) or registry:NAME.")
    parser.add_argument("out", nargs="?", default="", help="OUT.safetensors, or a folder / s3:// prefix.")
    parser.add_argument(
        "--open-clip-dir",
        default="",
        help="Instead of OUT: a folder OpenCLIP loads as local-dir:DIR and the Hugging Face Hub takes as it is.",
    )
    parser.add_argument(
        "--transformers-dir",
        default="",
        help="Instead of OUT: a folder Hugging Face transformers loads as CLIPModel.from_pretrained(DIR).",
    )
    parser.add_argument(
        "--model",
        default="",
        help="With --open-clip-dir or --transformers-dir: the model, if SRC does not say.",
    )
    parser.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES, help="dtype of the weights written.")
    parser.add_argument(
        "--max-shard-size", default="", help="Split into shards of at most this size, e.g. 5GB."
    )
    parser.add_argument(
        "--with-optimizer", action="store_true", help="Also write Adam state and train state."
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace existing output files.")
    parser.add_argument(
        "--piece-size", default="16MiB", help="Bytes read per request (memory: pieces in flight)."
    )
    parser.add_argument("--read-ahead", type=int, default=4, help="Pieces read ahead on threads.")
    add_config_flags(parser, CheckpointConfig, ("registry", "s3_endpoint", "s3_region"))
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    return parser


def parse_consolidate_args(argv: list[str]) -> argparse.Namespace:
    """The options, every check argv (and the local file system, for SRC) can settle done."""
    parser = consolidate_parser()
    args = parser.parse_args(argv)
    if sum(map(bool, (args.out, args.open_clip_dir, args.transformers_dir))) != 1:
        parser.error("give OUT, --open-clip-dir DIR or --transformers-dir DIR (one of them)")
    if args.open_clip_dir and (args.max_shard_size or args.with_optimizer):
        parser.error(
            "--open-clip-dir writes one weights file (OpenCLIP's loader reads one), without optimizer state"
        )
    if args.transformers_dir and args.with_optimizer:
        parser.error(
            "--transformers-dir writes the model's weights, without optimizer state (CLIPModel holds none)"
        )
    if args.max_shard_size:
        _size("--max-shard-size", args.max_shard_size)
    args.piece_bytes = _size("--piece-size", args.piece_size)
    if args.read_ahead < 1:
        raise ConfigError(f"--read-ahead {args.read_ahead}: give at least 1 piece (default 4)")
    if args.src.startswith(REGISTRY_SCHEME) and not registry_uri(args.registry or ""):
        raise ConfigError(f"{args.src}: no registry given; pass --registry PATH|s3://bucket/prefix or set "
                          "BIGCLIP_REGISTRY")  # fmt: skip
    _check_local_source(args.src)
    for flag, out in (
        ("OUT", args.out),
        ("--open-clip-dir", args.open_clip_dir),
        ("--transformers-dir", args.transformers_dir),
    ):
        if out:
            _check_local_out(flag, out)
    return args


def _size(flag: str, text: str) -> int:
    try:
        size = parse_size(text)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None
    if size < 1:
        raise ConfigError(f"{flag} {text!r}: give a positive size, e.g. 5GB or 16MiB")
    return size


def _check_local_source(src: str) -> None:
    """A local SRC that does not exist fails here; URIs (s3://, http(s)://, registry:) are opened later."""
    if not is_local(src) or src.startswith(REGISTRY_SCHEME) or Path(local_path(src)).exists():
        return
    raise StorageError(
        f"{src} does not exist: it is neither a weights file (.safetensors, .pt, .bin) nor a committed bigclip "
        "checkpoint (a folder with manifest.json) nor a folder of them; check the path, or give an s3:// URI "
        "or registry:NAME"
    )


def _check_local_out(flag: str, out: str) -> None:
    """An existing file where the output's folder must be (a folder OUT or export folder, or the
    parent of OUT FILE.safetensors) fails here, before anything is read."""
    if not is_local(out):
        return
    path = Path(local_path(out))
    folder = path.parent if flag == "OUT" and path.name.endswith(".safetensors") else path
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"{flag} {out}: {folder} is a file, where the output's folder goes (OUT is FILE.safetensors or a "
            "folder, the export options name folders); give another path"
        )


def main(argv: list[str]) -> int:
    args = parse_consolidate_args(argv)
    from bigclip.weights.consolidate import consolidate  # torch: only for options that hold

    configure_storage(s3_endpoint=args.s3_endpoint or "", s3_region=args.s3_region or "")
    result = consolidate(
        args.src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
        with_optimizer=args.with_optimizer, overwrite=args.overwrite, registry=args.registry or "",
        progress=not args.no_progress, piece_bytes=args.piece_bytes, read_ahead=args.read_ahead,
        open_clip_dir=args.open_clip_dir, transformers_dir=args.transformers_dir, model=args.model,
    )  # fmt: skip
    plan = result.plan
    for name in plan.names():
        print(f"{plan.folder.rstrip('/')}/{name}  {human_bytes(result.records[name].size)}")
    return 0
