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
from bigclip.storage.locations import Location
from bigclip.storage.records import CHECKSUM_ALGORITHM, ObjectRecord, sha256_of_stream
from bigclip.storage.redact import redact

MANIFEST_NAME = "manifest.json"
RANK_RECORDS = "rank_records/1"  # `layout`: every rank's metadata in its record (rank_record.py)
FORMAT = "bigclip-checkpoint"
VERSION = 1


@dataclass
class Manifest:
    step: int
    world_size: int
    objects: dict[str, ObjectRecord]
    engine: str = ""
    model: str = ""
    created: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    layout: str = ""  # how ranks find their metadata: "" (DCP's .metadata only) or RANK_RECORDS
    prefixes: str = ""  # how each rank's objects are named (storage/rank_prefixes.py)
    uri: str = ""  # where it was read from; not stored

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects.values())

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
            objects=dict(sorted(objects.items())),
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
            if body.get("format") != FORMAT:
                raise ValueError(f"format {body.get('format')!r}")
            if body.get("version", 0) > VERSION:
                raise ValueError(f"version {body['version']} is newer than this bigclip ({VERSION})")
            objects = {name: ObjectRecord(**rec) for name, rec in body["objects"].items()}
            fields = {k: body[k] for k in ("step", "world_size", "engine", "model", "created", "meta")}
            fields["layout"] = str(body.get("layout", ""))  # absent before rank records
            fields["prefixes"] = str(body.get("prefixes", ""))
        except (ValueError, KeyError, TypeError) as e:
            raise StorageError(f"{uri or 'manifest'}: not a bigclip checkpoint manifest ({e})") from e
        return cls(objects=objects, uri=uri, **fields)


def size_problems(manifest: Manifest, files: dict[str, int]) -> list[str]:
    """Objects the manifest lists that are missing or have another size in `files`."""
    problems = []
    for name, record in manifest.objects.items():
        if name not in files:
            problems.append(f"{name}: missing")
        elif files[name] != record.size:
            problems.append(f"{name}: {files[name]} bytes, manifest says {record.size}")
    return problems


def checksum_problems(location: Location, folder: str, manifest: Manifest) -> list[str]:
    """Re-read every object and compare its SHA-256 with the manifest's."""
    problems = []
    for name, record in manifest.objects.items():
        try:
            with location.open_read(f"{folder}/{name}") as stream:
                actual = sha256_of_stream(stream)
        except Exception as e:  # missing or unreadable: report it with the rest
            problems.append(f"{name}: cannot read ({e})")
            continue
        if actual != record:
            problems.append(
                f"{name}: content differs from the manifest (size {actual.size}, sha256 mismatch)"
            )
    return problems
