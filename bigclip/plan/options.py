"""`bigclip plan`'s options, parsed and checked without torch: the planner's own (--gpus and the
hardware it assumes) and every `bigclip train` flag, through the training parser. Everything argv
alone settles fails here, before the planner imports torch and builds the model on the meta device
(seconds), so a bad flag costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from bigclip.cli_args import parse_train_args
from bigclip.config import TrainConfig
from bigclip.errors import ConfigError
from bigclip.storage.save_requests import PART_BYTES


@dataclass(frozen=True)
class Hardware:
    gpu_memory_gib: float = 80.0
    headroom: float = 0.08  # CUDA context, NCCL buffers, allocator fragmentation
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.40
    part_size_mib: float = PART_BYTES / 2**20  # the checkpoint writer's multipart part size
    link_gbps: float = 400.0  # network per GPU between nodes: one 400 Gbit/s NIC per H100 (DGX H100)


@dataclass(frozen=True)
class PlanOptions:
    gpus: int
    hardware: Hardware
    train: TrainConfig
    train_argv: list[str]  # the training flags as given (the dry run parses them again)
    json: bool = False
    markdown: bool = False
    dry_run: bool = False


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bigclip plan",
        usage="bigclip plan --gpus N [planner options] [any `bigclip train` option]",
        description="Plan a run: the planner options below, plus the run's training options, read as "
        "`bigclip train` reads them (listed by `bigclip train --help [SECTION]`).",
    )
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs in the run (one rank each).")
    p.add_argument("--gpu-memory-gib", type=float, default=Hardware.gpu_memory_gib, metavar="X",
                   help="Memory per GPU. (default: %(default)s)")  # fmt: skip
    p.add_argument("--headroom", type=float, default=Hardware.headroom, metavar="X",
                   help="Fraction of GPU memory kept free (CUDA context, NCCL, fragmentation). (default: %(default)s)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=Hardware.peak_tflops, metavar="X",
                   help="Dense bf16 peak per GPU. (default: %(default)s, an H100 SXM)")  # fmt: skip
    p.add_argument("--mfu", type=float, default=Hardware.mfu, metavar="X",
                   help="Model FLOPs utilisation to assume. (default: %(default)s)")  # fmt: skip
    p.add_argument("--part-size-mib", type=float, default=Hardware.part_size_mib, metavar="X",
                   help="S3 multipart part size. (default: %(default)s)")  # fmt: skip
    p.add_argument("--link-gbps", type=float, default=Hardware.link_gbps, metavar="X",
                   help="Network bandwidth per GPU between nodes, Gbit/s (prices the loss exchange). "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    p.add_argument("--markdown", action="store_true", help="Print the table as Markdown.")
    p.add_argument("--dry-run", action="store_true",
                   help="Also build rank 0's real sharded model under a fake process group and compare.")  # fmt: skip
    return p


MIN_MFU = 0.01  # large trainings reach 0.3-0.6 of peak; a value below this is a typo, not a plan


def hardware_from(args: argparse.Namespace) -> Hardware:
    if not MIN_MFU <= args.mfu <= 1:  # below it every time the plan prices is off by orders of magnitude
        raise ConfigError(
            f"--mfu {args.mfu:g}: give the fraction of the GPUs' peak FLOP/s the run reaches, from {MIN_MFU:g} "
            "to 1 (e.g. 0.4 for 40%)"
        )
    if not 0 <= args.headroom < 1 or not args.link_gbps > 0:
        raise ConfigError("--headroom must be in [0, 1) and --link-gbps above 0")
    for flag in ("gpu_memory_gib", "peak_tflops", "part_size_mib"):
        value = getattr(args, flag)
        if not 0 < value < math.inf:
            raise ConfigError(f"--{flag.replace('_', '-')} {value:g}: give a positive number")
    return Hardware(
        gpu_memory_gib=args.gpu_memory_gib, headroom=args.headroom, peak_tflops=args.peak_tflops,
        mfu=args.mfu, part_size_mib=args.part_size_mib, link_gbps=args.link_gbps,
    )  # fmt: skip


def parse_plan_args(argv: list[str]) -> PlanOptions:
    """The plan's options from `argv`, every check argv can settle done (ConfigError otherwise)."""
    args, train_argv = plan_parser().parse_known_args(argv)
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: must be at least 1 (the GPUs of the run, one rank each)")
    hardware = hardware_from(args)
    cfg = parse_train_args(train_argv)
    return PlanOptions(gpus=args.gpus, hardware=hardware, train=cfg, train_argv=train_argv,
                       json=args.json, markdown=args.markdown, dry_run=args.dry_run)  # fmt: skip
