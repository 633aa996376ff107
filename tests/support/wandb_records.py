"""Read what wandb wrote offline (`WANDB_MODE=offline`): the records of a run's `run-ID.wandb` file.

The file is `:W&B`, a 2-byte magic and a version byte, then LevelDB's log format: 32 KiB blocks
of chunks (CRC32, length, type FULL/FIRST/MIDDLE/LAST) carrying wandb's protobuf `Record`s.
wandb itself has no reader for it in Python any more; this one is for tests only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0:  # zero padding at the end of a block
            pos += left
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def history(path: Path) -> list[dict[str, Any]]:
    """Every `wandb.log` call's values, in order."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
    return rows


def run_info(path: Path) -> dict[str, Any]:
    """The run record: id, project, name, notes and config."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            config = {i.key: json.loads(i.value_json) for i in run.config.update}
            return {"id": run.run_id, "project": run.project, "name": run.display_name, "notes": run.notes,
                    "config": config}  # fmt: skip
    raise AssertionError(f"{path} has no run record")
