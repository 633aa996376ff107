"""How a checkpoint save on S3 is cut into objects and requests: one place for the writer
(s3_dcp_writer.py) and the planner (plan/planner.py), which needs no S3 library to count them.

Every upload of the checkpoint client is multipart: 2 + parts requests an object (create, the
parts, complete), parts of PART_BYTES. Objects per rank (`files_for`): each costs requests and a
second upload stream buys no bandwidth. The CRT client sends one stream's parts concurrently, and
the planner's conservative figure, 0.5 GB/s per node (launch/slurm.py), gives each of 8 ranks
62.5 MB/s, which one stream sustains. What one stream does serially is pickle and hash (SHA-256,
~1 GB/s a stream): one object per GiB of shard keeps that under a second per object, at most
MAX_FILES (DCP's default of 4 threads). A 1024-rank ViT-bigG-14 save: ~33 MiB per rank, one
object of one part, 3 requests.
"""

from __future__ import annotations

import math

PART_BYTES = 64 << 20  # at 8 MiB (the client's default) a ~33 MiB shard is 5 parts, 7 requests
STREAM_BYTES = 1 << 30
MAX_FILES = 4


def files_for(nbytes: int) -> int:
    """Objects a rank writes for a shard of `nbytes`."""
    return max(1, min(MAX_FILES, math.ceil(nbytes / STREAM_BYTES)))


def upload_requests(nbytes: int, *, part_bytes: int = PART_BYTES) -> int:
    """Requests of one object's multipart upload: create, its parts, complete."""
    return 2 + max(1, math.ceil(nbytes / part_bytes))
