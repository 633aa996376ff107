"""Where shards and their sizes.json are read from: storage locations opened for data workers.

Every data location is opened `fork_safe` (storage/locations.py): shards are streamed in data
workers, which are forked processes, so each process gets its own client (on S3: boto3, with
reconnects mid-object, storage/s3_stream.py). A shard streams from any byte
(`location.open_read(name, start=...)`): a resumed reader starts mid-shard (a seek locally, a
ranged GET on S3) without reading the consumed prefix. Any registered scheme serves shards.
"""

from __future__ import annotations

import tarfile

from bigclip.errors import BigclipError
from bigclip.storage.locations import Location, open_location, open_parent


def data_location(uri: str, *, fast_fail: bool = False) -> Location:
    """The location of a shard folder; `fast_fail` for validation (a wrong bucket fails in seconds)."""
    return open_location(uri, fork_safe=True, fast_fail=fast_fail)


def shard_location(url: str) -> tuple[Location, str]:
    """(the location of the folder holding shard `url`, the shard's name there)."""
    return open_parent(url, fork_safe=True)


def read_errors(location: Location) -> tuple[type[BaseException], ...]:
    """What reading a shard there raises when it is truncated or unreadable."""
    return (tarfile.TarError, EOFError, OSError, BigclipError, *location.read_errors)
