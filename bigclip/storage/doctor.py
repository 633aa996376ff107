"""`bigclip doctor s3://bucket/prefix`: test a checkpoint location before a long run.

Runs the same access checks as the training preflight (credentials, list, put, get,
delete), then times one upload and one download of `--size-mb` through the client
checkpoints use, printing a PASS/FAIL line per check. Exit status 0 only if all passed.
Works on a local folder too (then it measures the disk).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from bigclip.cli_args import ArgumentParser, add_config_flags
from bigclip.config import CheckpointConfig
from bigclip.errors import ConfigError
from bigclip.storage.settings import configure_storage

if TYPE_CHECKING:  # imported by main once the options are checked: they load torch (seconds)
    from bigclip.storage.access_checks import CheckResult
    from bigclip.storage.locations import Location


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="bigclip doctor", description="Check a checkpoint location's permissions and throughput."
    )
    parser.add_argument("location", help="s3://bucket/prefix or a local folder, as for --checkpoint-dir")
    group = parser.add_argument_group("S3")
    add_config_flags(group, CheckpointConfig, ("s3_endpoint", "s3_region"))  # as `bigclip train` has them
    parser.add_argument(
        "--size-mb", type=int, default=64, help="Object size for the throughput test (0: skip)."
    )
    parser.add_argument("--timeout-s", type=float, default=30.0, help="Give up on a check after this long.")
    return parser


def throughput_checks(location: Location, *, size_mb: int) -> list[tuple[str, Callable[[], str]]]:
    """Upload, download and delete one object of `size_mb`; detail lines carry MB/s."""
    from bigclip.storage.access_checks import probe_name

    key = probe_name() + ".bin"
    payload = os.urandom(1 << 20) * size_mb  # incompressible, built once

    def upload() -> str:
        started = time.perf_counter()
        location.write_bytes(key, payload)
        return _rate(size_mb, time.perf_counter() - started)

    def download() -> str:
        started = time.perf_counter()
        data = location.read_bytes(key)
        seconds = time.perf_counter() - started
        if data != payload:
            raise RuntimeError("downloaded bytes differ from the uploaded ones")
        return _rate(size_mb, seconds)

    def cleanup() -> str:
        location.delete(key)
        return "test object deleted"

    return [(f"upload {size_mb} MB", upload), (f"download {size_mb} MB", download), ("cleanup", cleanup)]


def _rate(size_mb: int, seconds: float) -> str:
    return f"{size_mb / seconds:.1f} MB/s ({seconds:.2f}s)"


def print_result(result: CheckResult) -> None:
    status = "PASS" if result.ok else "FAIL"
    print(f"{status}  {result.name:<18} {result.detail}", flush=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.size_mb < 0 or args.timeout_s <= 0:
        raise ConfigError(f"--size-mb must be 0 (no throughput test) or more and --timeout-s positive, got "
                          f"{args.size_mb} and {args.timeout_s:g}")  # fmt: skip
    from bigclip.storage.access_checks import access_checks, run_check
    from bigclip.storage.locations import open_location

    configure_storage(s3_endpoint=args.s3_endpoint or "", s3_region=args.s3_region or "")
    location = open_location(args.location, max_attempts=2)
    print(f"bigclip doctor: {location.uri}")
    checks = access_checks(location)
    if args.size_mb > 0:
        checks += throughput_checks(location, size_mb=args.size_mb)
    failed, first_failure = 0, ""
    for name, fn in checks:
        result = run_check(name, fn, timeout_s=args.timeout_s)
        print_result(result)
        if not result.ok:
            failed += 1
            first_failure = first_failure or f"{location.uri}: {name}: {result.detail}"
            if name in ("credentials", "list", "folder", "put") or name.startswith("upload"):
                break  # later checks need this one; their failures would only repeat it
    print("all checks passed" if not failed else f"{failed} check(s) failed", flush=True)
    if failed:  # the line a user reads last: what failed first, and what to fix
        print(f"bigclip doctor: error: {first_failure}", file=sys.stderr)
    return 0 if not failed else 1
