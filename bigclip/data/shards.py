"""Shard patterns: expansion, existence check, and per-shard sample counts.

Patterns are OpenCLIP's: brace ranges (`/data/{00000..00099}.tar`,
`s3://bucket/prefix/{00000..41455}.tar`), several sources joined with `::`.
`validate_shards` checks that the shards exist before any model is built, by listing:
one `scandir` per local directory; on S3 the common key prefix of each directory
(1,000 keys per request, so 41k shards cost ~42 requests, not 41k HEADs). A pattern matching no shard is a
`DataError`; a pattern matching only some is logged and the missing ones are left out (as
OpenCLIP's trainer does with img2dataset output, where failed shards leave gaps).

`--train-data-upsampling-factors 1::2::0.5` gives each `::` source a weight; with
--dataset-resampled a shard is drawn with probability proportional to its source's weight
(OpenCLIP's `ResampledShards2`: every shard of a source carries the source's factor, so a
source's share also grows with its shard count). `with_weights` attaches them.

Sample counts come from `sizes.json` beside the shards (`{"00000.tar": 10000, ...}`, the
webdataset / img2dataset convention that OpenCLIP reads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import posixpath
from collections import defaultdict
from dataclasses import dataclass

from braceexpand import UnbalancedBracesError, braceexpand

from bigclip.errors import DataError
from bigclip.storage.s3 import S3Settings, boto3_client, is_s3, join_s3_uri, split_s3_uri

log = logging.getLogger("bigclip.data")

SIZES_FILE = "sizes.json"


@dataclass(frozen=True)
class ShardList:
    """The shards of a pattern that exist, in pattern order, with their sample counts when known."""

    pattern: str
    urls: tuple[str, ...]
    sizes: tuple[int | None, ...]
    missing: tuple[str, ...] = ()
    weights: tuple[float, ...] | None = None  # per shard, from --train-data-upsampling-factors

    def __len__(self) -> int:
        return len(self.urls)

    @property
    def total_samples(self) -> int | None:
        """Samples in all shards, or None when sizes.json does not cover every shard."""
        if any(size is None for size in self.sizes):
            return None
        return sum(self.sizes)  # type: ignore[arg-type]

    @property
    def fingerprint(self) -> str:
        """Identifies the shard list; a resumed position must have been saved over the same list.

        Paths are taken relative to the shards' common folder, so a dataset moved (say from S3
        to a local cache) between save and resume still matches.
        """
        root = os.path.commonprefix(list(self.urls)).rpartition("/")[0]
        relative = [u[len(root) :] for u in self.urls]
        if self.weights is not None:  # resampled draws depend on them
            relative += [repr(w) for w in self.weights]
        return hashlib.sha256("\n".join(relative).encode()).hexdigest()[:16]

    def cumulative_weights(self) -> list[float]:
        """Running sums of the draw weights (1 per shard without upsampling factors)."""
        total, out = 0.0, []
        for w in self.weights or (1.0,) * len(self.urls):
            total += w
            out.append(total)
        return out

    def with_weights(self, factors: str) -> ShardList:
        """Per-shard weights from '1::2::0.5' (one factor per '::' source of the pattern)."""
        if not factors:
            return self
        sources = self.pattern.split("::")
        try:
            values = [float(f) for f in factors.split("::")]
        except ValueError:
            values = []
        if len(values) != len(sources) or min(values, default=-1) < 0 or not any(values):
            raise DataError(
                f"--train-data-upsampling-factors {factors!r} needs one non-negative number per '::' source of "
                f"--train-data ({len(sources)} source(s)), not all zero, e.g. {'::'.join(['1'] * len(sources))}"
            )
        weight: dict[str, float] = {}
        for source, value in zip(sources, values):
            for url in expand_pattern(source):  # a shard listed in two sources carries both weights
                weight[url] = weight.get(url, 0.0) + value
        weights = tuple(weight[u] for u in self.urls)
        if not any(weights):
            raise DataError(
                f"--train-data-upsampling-factors {factors!r} gives every existing shard weight 0"
            )
        return dataclasses.replace(self, weights=weights)


def expand_pattern(pattern: str, *, what: str = "shard pattern") -> list[str]:
    """'a/{0..2}.tar::b/x.tar' -> ['a/0.tar', 'a/1.tar', 'a/2.tar', 'b/x.tar'] (order kept, no duplicates)."""
    urls: list[str] = []
    for source in pattern.split("::"):
        try:
            urls.extend(u.strip() for u in braceexpand(source.strip()) if u.strip())
        except UnbalancedBracesError:
            raise DataError(f"{what} {pattern!r}: unbalanced braces in {source.strip()!r}; close each range, "
                            "e.g. /data/{00000..00099}.tar") from None  # fmt: skip
    return list(dict.fromkeys(urls))


def validate_shards(pattern: str, *, s3: S3Settings | None = None, what: str = "--train-data") -> ShardList:
    """The existing shards of `pattern`; `DataError` (in seconds) when none exists or S3 is unreachable."""
    if not pattern.strip():
        raise DataError(f"{what} is empty; give a shard pattern such as /data/{{00000..00099}}.tar")
    urls = expand_pattern(pattern, what=what)
    settings = (s3 or S3Settings.resolve()) if any(is_s3(u) for u in urls) else None
    found = _existing(urls, settings)
    existing = [u for u in urls if u in found]
    missing = [u for u in urls if u not in found]
    if not existing:
        raise DataError(
            f"{what} {pattern!r} matches no shard: none of its {len(urls)} path(s) exists "
            f"(first: {urls[0]}{_endpoint_note(settings)}). Check the path, the brace range and, for S3, "
            "the bucket, prefix and AWS_ENDPOINT_URL."
        )
    if missing:
        log.warning(
            "%s: %d of %d shards are missing and left out, e.g. %s",
            what,
            len(missing),
            len(urls),
            missing[:3],
        )
    sizes = _sizes(existing, settings)
    return ShardList(pattern=pattern, urls=tuple(existing), sizes=tuple(sizes), missing=tuple(missing))


def _endpoint_note(settings: S3Settings | None) -> str:
    if settings is None:
        return ""
    return f", S3 endpoint {settings.endpoint or 'AWS'}"


def _existing(urls: list[str], settings: S3Settings | None) -> set[str]:
    local = [u for u in urls if not is_s3(u)]
    remote = [u for u in urls if is_s3(u)]
    return _existing_local(local) | (_existing_s3(remote, settings) if remote else set())


def _existing_local(paths: list[str]) -> set[str]:
    """One directory listing per directory: on network filesystems 41k stat calls take minutes."""
    by_dir: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        by_dir[os.path.dirname(path)].append(path)
    found: set[str] = set()
    for directory, members in by_dir.items():
        try:
            names = {e.name for e in os.scandir(directory or ".") if e.is_file()}
        except OSError:  # missing or unreadable directory: none of its shards exist
            continue
        found.update(p for p in members if os.path.basename(p) in names)
    return found


def _existing_s3(urls: list[str], settings: S3Settings) -> set[str]:
    """List each directory's common key prefix once instead of one HEAD per shard."""
    by_dir: dict[tuple[str, str], list[str]] = defaultdict(list)
    for url in urls:
        bucket, key = split_s3_uri(url)
        by_dir[(bucket, posixpath.dirname(key))].append(key)
    found: set[str] = set()
    for (bucket, _), keys in by_dir.items():
        listed = _list_keys(bucket, os.path.commonprefix(keys), settings)
        found.update(join_s3_uri(bucket, k) for k in keys if k in listed)
    return found


def _list_keys(bucket: str, prefix: str, settings: S3Settings) -> set[str]:
    client = boto3_client(settings, fast_fail=True)  # first: names boto3 if it is missing
    from botocore.exceptions import BotoCoreError, ClientError

    keys: set[str] = set()
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys.update(obj["Key"] for obj in page.get("Contents", ()))
    except (BotoCoreError, ClientError) as e:
        raise DataError(
            f"cannot list s3://{bucket}/{prefix} at {settings.endpoint or 'AWS S3'} ({settings.region_name}): {e}. "
            "Check the bucket name, credentials and AWS_ENDPOINT_URL."
        ) from e
    return keys


def _sizes(urls: list[str], settings: S3Settings | None) -> list[int | None]:
    """Per-shard sample counts from each directory's sizes.json (None where not listed)."""
    tables: dict[str, dict[str, int]] = {}
    sizes: list[int | None] = []
    for url in urls:
        directory, name = url.rsplit("/", 1) if "/" in url else (".", url)
        if directory not in tables:
            tables[directory] = read_sizes_json(directory, settings)
        size = tables[directory].get(name)
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise DataError(
                f"{directory}/{SIZES_FILE} lists {size!r} samples for {name}, not a count; recount with "
                "`bigclip index-shards PATTERN` (it rewrites the file)"
            )
        sizes.append(size)
    return sizes


def read_sizes_json(directory: str, settings: S3Settings | None) -> dict[str, int]:
    path = f"{directory}/{SIZES_FILE}"
    try:
        text = _read_small_s3_object(path, settings) if is_s3(path) else _read_local_text(path)
        table = json.loads(text) if text is not None else {}
        if not isinstance(table, dict):
            raise TypeError(f"it holds a {type(table).__name__}")
        return table
    except (ValueError, TypeError) as e:
        raise DataError(
            f"{path} is not a JSON object of shard name -> sample count ({e}): recount with "
            "`bigclip index-shards PATTERN`, or delete the file and pass --train-num-samples"
        ) from e


def _read_local_text(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def _read_small_s3_object(url: str, settings: S3Settings | None) -> str | None:
    from botocore.exceptions import ClientError

    bucket, key = split_s3_uri(url)
    try:
        body = boto3_client(settings or S3Settings.resolve(), fast_fail=True).get_object(
            Bucket=bucket, Key=key
        )
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise DataError(f"cannot read {url}: {e}") from e
    return body["Body"].read().decode("utf-8")
