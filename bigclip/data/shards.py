"""Shard patterns: expansion, existence check, and per-shard sample counts.

Patterns are OpenCLIP's: brace ranges (`/data/{00000..00099}.tar`,
`s3://bucket/prefix/{00000..41455}.tar`), several sources joined with `::`.
`validate_shards` checks that the shards exist before any model is built, by listing each
directory once: a `scandir` locally, a listing of the prefix on an object store (S3: 1,000
keys per request, so 41k shards cost ~42 requests, not 41k HEADs), which also tells whether
a sizes.json is there. A pattern matching no shard is a
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
import itertools
import json
import logging
import os
from dataclasses import dataclass

from braceexpand import UnbalancedBracesError, braceexpand

from bigclip.config.data import names_no_shard
from bigclip.data.streams import data_location
from bigclip.errors import BigclipError, DataError
from bigclip.storage.locations import LocalLocation, Location
from bigclip.storage.schemes import is_local, scheme_of

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
    repeated: int = 0  # names the pattern gave more than once (each shard is listed once)

    def __len__(self) -> int:
        return len(self.urls)

    @property
    def total_samples(self) -> int | None:
        """Samples in all shards, or None when sizes.json does not cover every shard."""
        return None if None in self.sizes else sum(self.sizes)  # type: ignore[arg-type]

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
        return list(itertools.accumulate(self.weights or (1.0,) * len(self.urls)))

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
    return list(dict.fromkeys(_expand(pattern, what=what)))


def _expand(pattern: str, *, what: str) -> list[str]:
    urls: list[str] = []
    for source in pattern.split("::"):
        try:
            urls.extend(u.strip() for u in braceexpand(source.strip()) if u.strip())
        except UnbalancedBracesError:
            raise DataError(f"{what} {pattern!r}: unbalanced braces in {source.strip()!r}; close each range, "
                            "e.g. /data/{00000..00099}.tar") from None  # fmt: skip
    if not urls:
        raise DataError(names_no_shard(what, pattern))
    return urls


def validate_shards(pattern: str, *, what: str = "--train-data") -> ShardList:
    """The existing shards of `pattern`; `DataError` (in seconds) when none exists or a store is unreachable."""
    if not pattern.strip():
        raise DataError(f"{what} is empty; give a shard pattern such as /data/{{00000..00099}}.tar")
    named = _expand(pattern, what=what)
    urls = list(dict.fromkeys(named))
    folders = {directory: _Folder.list(directory) for directory in dict.fromkeys(map(_directory, urls))}
    existing = [u for u in urls if _name(u) in folders[_directory(u)].names]
    missing = [u for u in urls if _name(u) not in folders[_directory(u)].names]
    if not existing:
        folder = next((u for u in urls if is_local(u) and os.path.isdir(u)), "")
        if folder:
            raise DataError(f"{what} {pattern!r}: {folder} is a folder; name its shards, e.g. "
                            f"{folder.rstrip('/')}/{{00000..00099}}.tar")  # fmt: skip
        service = folders[_directory(urls[0])].location.service
        raise DataError(
            f"{what} {pattern!r} matches no shard: none of its {len(urls)} path(s) exists "
            f"(first: {urls[0]}{f', {service}' if service else ''}). {_advice(urls[0])}"
        )
    if missing:
        log.warning(
            "%s: %d of %d shards are missing and left out, e.g. %s",
            what,
            len(missing),
            len(urls),
            missing[:3],
        )
    tables = {d: folders[d].sizes() for d in dict.fromkeys(map(_directory, existing))}
    sizes = [_checked_size(tables[_directory(u)].get(_name(u)), u) for u in existing]
    return ShardList(pattern=pattern, urls=tuple(existing), sizes=tuple(sizes), missing=tuple(missing),
                     repeated=len(named) - len(urls))  # fmt: skip


def _advice(url: str) -> str:
    """What to check when nothing matched, for the form the pattern has."""
    if url.startswith("pipe:"):
        return ("webdataset's pipe: commands are not run: give the shards' paths or s3:// URIs (bigclip streams "
                "them itself)")  # fmt: skip
    if any(c in url for c in "*?["):
        return "Glob patterns are not expanded: name the shards with a brace range, e.g. /data/{00000..00099}.tar."
    if not is_local(url) and scheme_of(url) != "s3":
        return "Check the address and that the server lists the folder."
    return "Check the path, the brace range and, for S3, the bucket, prefix and AWS_ENDPOINT_URL."


def _directory(url: str) -> str:
    return url.rsplit("/", 1)[0] if "/" in url else "."


def _name(url: str) -> str:
    return url.rsplit("/", 1)[-1]


@dataclass
class _Folder:
    """One directory of shards: its location and the names in it (listed once)."""

    location: Location
    names: set[str]

    @classmethod
    def list(cls, directory: str) -> _Folder:
        location = data_location(directory, fast_fail=True)
        if isinstance(location, LocalLocation):
            return cls(location, _local_names(location.root))
        try:
            return cls(location, set(location.list_files("")))
        except (BigclipError, *location.read_errors) as e:
            where = f" ({location.service})" if location.service else ""
            check = ("Check the bucket name, credentials and AWS_ENDPOINT_URL" if scheme_of(location.uri) == "s3"
                     else "Give shards in a local folder or an object store bigclip can list (s3://)")  # fmt: skip
            raise DataError(f"cannot list {location.uri}/{where}: {e}. {check}.") from e

    def sizes(self) -> dict[str, int]:
        """sizes.json's table ({} without one)."""
        return parse_sizes(self.location) if SIZES_FILE in self.names else {}


def _local_names(directory: os.PathLike) -> set[str]:
    """One directory listing: on network filesystems 41k stat calls take minutes."""
    try:
        return {e.name for e in os.scandir(directory) if e.is_file()}
    except OSError:  # missing or unreadable directory: none of its shards exist
        return set()


def _checked_size(size: object, url: str) -> int | None:
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        directory, name = _directory(url), _name(url)
        raise DataError(
            f"{directory}/{SIZES_FILE} lists {size!r} samples for {name}, not a count; recount with "
            "`bigclip index-shards PATTERN` (it rewrites the file)"
        )
    return size  # type: ignore[return-value]


def read_sizes_json(directory: str) -> dict[str, int]:
    """The sizes.json in `directory` ({} when there is none)."""
    location = data_location(directory, fast_fail=True)
    return parse_sizes(location) if location.exists(SIZES_FILE) else {}


def parse_sizes(location: Location) -> dict[str, int]:
    path = location.child_uri(SIZES_FILE)
    try:
        text = location.read_bytes(SIZES_FILE).decode("utf-8")
    except (BigclipError, *location.read_errors) as e:
        raise DataError(f"cannot read {path}: {e}") from e
    try:
        table = json.loads(text)
        if not isinstance(table, dict):
            raise TypeError(f"it holds a {type(table).__name__}")
        return table
    except (ValueError, TypeError) as e:
        raise DataError(
            f"{path} is not a JSON object of shard name -> sample count ({e}): recount with "
            "`bigclip index-shards PATTERN`, or delete the file and pass --train-num-samples"
        ) from e
