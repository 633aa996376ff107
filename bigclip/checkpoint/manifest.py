"""The manifest: a checkpoint's commit marker and inventory.

Written last, by rank 0, only after every rank's shard files and DCP's `.metadata` are
durable; a checkpoint folder without `manifest.json` is an interrupted save and is never
resumed from. It lists every object with its size and SHA-256 (computed while writing),
plus step, world size, engine, model name, creation time and the caller's metadata
(credentials redacted). Loading checks sizes against one listing (cheap); checksums are
checked by `verify_checksums` (re-reads everything; `CheckpointStore.verify`).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from bigclip.errors import StorageError
from bigclip.storage.records import CHECKSUM_ALGORITHM, Inventory, ObjectRecord
from bigclip.storage.redact import redact

MANIFEST_NAME = "manifest.json"
RANK_RECORDS = "rank_records/1"  # `layout`: every rank's metadata in its record (rank_record.py)
FORMAT = "bigclip-checkpoint"
VERSION = 1


@dataclass
class Manifest:
    step: int
    world_size: int
    objects: Inventory
    engine: str = ""
    model: str = ""
    created: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    layout: str = ""  # how ranks find their metadata: "" (DCP's .metadata only) or RANK_RECORDS
    prefixes: str = ""  # how each rank's objects are named (storage/rank_prefixes.py)
    uri: str = ""  # where it was read from; not stored

    @property
    def total_bytes(self) -> int:
        return self.objects.total_bytes

    @classmethod
    def build(
        cls,
        *,
        step: int,
        world_size: int,
        objects: dict[str, ObjectRecord],
        meta: dict[str, Any],
        layout: str = "",
        prefixes: str = "",
    ) -> Manifest:
        meta = redact(dict(meta))
        return cls(
            step=step,
            world_size=world_size,
            objects=Inventory(sorted(objects.items())),
            engine=str(meta.get("engine", "")),
            model=str(meta.get("model", "")),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            meta=meta,
            layout=layout,
            prefixes=prefixes,
        )

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "version": VERSION, "checksum": CHECKSUM_ALGORITHM, **asdict(self)}
        body.pop("uri")
        return (json.dumps(body, indent=1, sort_keys=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, uri: str = "") -> Manifest:
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            if body.get("format") != FORMAT:
                raise ValueError(f"format {body.get('format')!r}")
            if body.get("version", 0) > VERSION:
                raise ValueError(f"version {body['version']} is newer than this bigclip ({VERSION})")
            if body.get("checksum", CHECKSUM_ALGORITHM) != CHECKSUM_ALGORITHM:  # what `objects` records
                raise ValueError(f"checksum {body['checksum']!r}, where bigclip records {CHECKSUM_ALGORITHM}")
            objects = Inventory.from_json(body["objects"])
            fields = {k: body[k] for k in ("step", "world_size", "engine", "model", "created", "meta")}
            fields["layout"] = str(body.get("layout", ""))  # absent before rank records
            if fields["layout"] not in ("", RANK_RECORDS):
                raise ValueError(f"layout {fields['layout']!r}, where this bigclip reads {RANK_RECORDS!r}")
            fields["prefixes"] = str(body.get("prefixes", ""))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StorageError(f"{uri or 'manifest'}: not a bigclip checkpoint manifest ({e})") from e
        return cls(objects=objects, uri=uri, **fields)
