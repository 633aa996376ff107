"""`bigclip index-shards PATTERN`: count the samples of existing shards into sizes.json.

    bigclip index-shards '/data/laion/{00000..41455}.tar'
    bigclip index-shards 's3://bucket/laion/{00000..41455}.tar' --threads 64
    bigclip index-shards '/data/laion/{00000..41455}.tar' --check   # compare, write nothing

Only tar headers are parsed: no member is decoded. Local shards are read by seeking from one
header to the next (a few KB per sample); remote objects are streamed once and their member
data skipped as it arrives (one GET per shard, which beats a ranged GET per header by orders of
magnitude). Shards are counted in parallel threads, with a progress bar.

A sample is what bigclip's reader yields (tar_samples.py): consecutive members sharing a key,
metadata members (`__*`, `.*`) left out. A corrupt member's *content* does not matter here
(the loader skips undecodable images and counts them); a damaged tar header or a shard cut
short ends the count at the last complete sample, as the reader would, and is reported.
Each directory's sizes.json is written beside its shards (merged with entries already there,
for shards of other patterns), so training finds it without --train-num-samples, and plans
epochs that read every sample once (resume/assignment.py). `--check` recounts and compares
with the sizes.json there, writing nothing: a shard whose count differs, one missing from
sizes.json, or a damaged one fails with one line naming them and the fix.
"""

from __future__ import annotations

import argparse
import json
import logging
import posixpath
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from bigclip.cli_args import ArgumentParser, add_config_flags
from bigclip.config import CheckpointConfig
from bigclip.data.shards import SIZES_FILE, read_sizes_json, validate_shards
from bigclip.data.streams import data_location, read_errors, shard_location
from bigclip.data.tar_samples import (
    check_clean_end,
    is_compressed,
    is_metadata,
    key_and_ext,
    recording_tarinfo,
)
from bigclip.errors import ConfigError, DataError
from bigclip.storage.locations import LocalLocation, Location
from bigclip.storage.progress import progress_bar
from bigclip.storage.settings import configure_storage

log = logging.getLogger("bigclip.data")
HEADER_READ_BYTES = 4096


@dataclass(frozen=True)
class ShardCount:
    url: str
    samples: int
    error: str = ""  # why counting stopped early ('' when the shard is whole)


def _open(location: Location, name: str, *, seekable: bool) -> BinaryIO:
    if not seekable:
        return location.open_read(name)
    # Small buffer: tarfile seeks from header to header, and each seek refills the buffer.
    return open(Path(location.root) / name, "rb", buffering=HEADER_READ_BYTES)  # noqa: SIM115 - the caller closes it


def count_samples(url: str) -> ShardCount:
    """Samples in one shard from its headers; a damaged or truncated shard counts up to the damage."""
    samples, key = 0, None
    location, name = shard_location(url)
    seekable = isinstance(location, LocalLocation) and not is_compressed(url)  # else streamed once
    try:
        size = None if is_compressed(url) else location.size(name)  # offsets are into the uncompressed stream
        mode = "r|gz" if is_compressed(url) else ("r:" if seekable else "r|")
        with _open(location, name, seekable=seekable) as stream:
            tar = tarfile.open(fileobj=stream, mode=mode, tarinfo=recording_tarinfo())  # noqa: SIM115
            for info in tar:
                name_key, _ = key_and_ext(info.name)
                if info.isreg() and not is_metadata(info.name) and name_key is not None and name_key != key:
                    samples, key = samples + 1, name_key  # counted on its first header, as the reader
                if size is not None and info.offset_data + info.size > size:
                    raise tarfile.ReadError(f"{info.name} is cut short at byte {size}")
                tar.members = []  # iteration keeps every TarInfo otherwise
            check_clean_end(tar)
    except (*read_errors(location), ValueError) as e:
        # The sample being read when the damage was found may be incomplete: the reader drops it too.
        return ShardCount(url, max(0, samples - 1) if key is not None else 0, f"{type(e).__name__}: {e}")
    return ShardCount(url, samples)


def index_shards(pattern: str, *, threads: int = 16, progress: bool = True) -> list[ShardCount]:
    """Count every existing shard of `pattern` (in pattern order)."""
    shards = validate_shards(pattern, what="index-shards")
    bar = progress_bar(len(shards), label="index-shards", unit="shard", enabled=progress)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        counts = []
        for count in pool.map(count_samples, shards.urls):
            counts.append(count)
            bar.update(1)
    bar.close()
    return counts


def write_sizes(counts: list[ShardCount]) -> list[str]:
    """sizes.json in each shard directory, merged with what is there; returns the files written. A
    damaged shard's count up to the damage is written only where sizes.json lists none: a count made
    before the damage (or by a reader of a format bigclip does not read) is kept."""
    by_dir: dict[str, dict[str, int]] = {}
    for c in counts:
        directory, name = posixpath.split(c.url) if "/" in c.url else (".", c.url)
        by_dir.setdefault(directory, {})[name] = c.samples
    damaged = {c.url for c in counts if c.error}
    written = []
    for directory, sizes in by_dir.items():
        listed = read_sizes_json(directory)
        kept = {n: listed[n] for n in sizes if n in listed and posixpath.join(directory, n) in damaged}
        merged = listed | sizes | kept
        text = json.dumps(dict(sorted(merged.items())), indent=0)
        data_location(directory).write_bytes(SIZES_FILE, text.encode())
        written.append(f"{directory}/{SIZES_FILE}")
    return written


def check_sizes(counts: list[ShardCount], *, pattern: str) -> int:
    """0 when sizes.json lists every shard with the count found and none is damaged; else DataError."""
    listed: dict[str, dict[str, int]] = {}
    wrong = []
    for c in counts:
        directory, name = posixpath.split(c.url) if "/" in c.url else (".", c.url)
        if directory not in listed:
            listed[directory] = read_sizes_json(directory)
        expected = listed[directory].get(name)
        if c.error:
            wrong.append(f"{c.url} is damaged ({c.error}; {c.samples} whole samples before it)")
        elif expected is None:
            wrong.append(f"{c.url} holds {c.samples} samples and sizes.json does not list it")
        elif expected != c.samples:
            wrong.append(f"{c.url} holds {c.samples} samples, sizes.json lists {expected}")
    if wrong:
        more = f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise DataError(
            f"{len(wrong)} of {len(counts)} shards of {pattern!r} disagree with sizes.json: {'; '.join(wrong[:3])}"
            f"{more}. Replace damaged shards, then run `bigclip index-shards {pattern!r}` to rewrite sizes.json"
        )
    print(f"sizes.json agrees with all {len(counts)} shards ({sum(c.samples for c in counts)} samples)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bigclip index-shards", description=__doc__.split("\n")[0])
    parser.add_argument("pattern", help="Shards: a brace pattern, local or s3://, '::' joins several.")
    parser.add_argument("--threads", type=int, default=16, help="Shards counted at once.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    parser.add_argument(
        "--check",
        action="store_true",
        help="Recount and compare with sizes.json; write nothing, fail on a difference.",
    )
    add_config_flags(parser.add_argument_group("S3"), CheckpointConfig, ("s3_endpoint", "s3_region"))
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: give at least 1 (shards counted at once; default 16)")
    configure_storage(s3_endpoint=args.s3_endpoint or "", s3_region=args.s3_region or "")
    counts = index_shards(args.pattern, threads=args.threads, progress=not args.no_progress)
    if args.check:
        return check_sizes(counts, pattern=args.pattern)
    for c in counts:
        if c.error:
            print(f"warning: {c.url}: counted {c.samples} samples up to the damage ({c.error})")
    for path in write_sizes(counts):
        print(f"wrote {path}")
    damaged = [c.url for c in counts if c.error]
    print(f"{sum(c.samples for c in counts)} samples in {len(counts)} shards ({len(damaged)} damaged)")
    if damaged:  # not 0: a script that indexes, then trains, must not go on as if all were counted
        raise DataError(
            f"{len(damaged)} of {len(counts)} shards could not be read to the end, e.g. {damaged[0]}: sizes.json "
            "keeps any count it had for them (else the count up to the damage); replace them (bigclip reads "
            ".tar, .tar.gz and .tgz) and run index-shards again"
        )
    return 0
