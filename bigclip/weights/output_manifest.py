"""The checksum manifest `bigclip consolidate` writes beside its output (`STEM.manifest.json`).

It lists every file written (shards, index) with its size and SHA-256, and is written last, so
its presence means the write completed. Readers of a consolidated file use it to check every
byte they read (`SafetensorsReader(checked=...)`); `bigclip publish` copies the files it lists.
A `.safetensors` file without such a manifest has no record to check against.
"""

from __future__ import annotations

import json
import logging
import re

from bigclip.checkpoint.integrity import size_differs
from bigclip.storage.locations import Location
from bigclip.storage.records import Inventory
from bigclip.weights.safetensors_format import INDEX_SUFFIX, Checked
from bigclip.weights.safetensors_writer import FORMAT, MANIFEST_SUFFIX

log = logging.getLogger("bigclip.weights")


def manifest_beside(location: Location, file_name: str) -> str | None:
    """The consolidation manifest beside `file_name` that lists it (or that it is), if any."""
    shard = re.fullmatch(r"(.*)-\d{5}-of-\d{5}\.safetensors", file_name)
    stem = shard.group(1) if shard else file_name
    for suffix in (MANIFEST_SUFFIX, INDEX_SUFFIX, ".safetensors"):
        stem = stem.removesuffix(suffix)
    candidate = stem + MANIFEST_SUFFIX
    if not location.exists(candidate):
        return None
    try:
        body = json.loads(location.read_bytes(candidate))
    except ValueError:
        log.warning("%s is not readable JSON: %s is read unchecked", location.child_uri(candidate), file_name)
        return None
    listed = file_name == candidate or file_name in body.get("files", {})
    return candidate if body.get("format") == FORMAT and listed else None


def checked_files(location: Location, file_name: str) -> dict[str, Checked]:
    """Every file the manifest beside `file_name` lists, with its record; {} without a manifest.
    Sizes are compared here (one listing), so a truncated or grown file fails before any read."""
    manifest = manifest_beside(location, file_name)
    if manifest is None:
        return {}
    files = Inventory.from_json(json.loads(location.read_bytes(manifest))["files"])
    advice = (
        f"copy it again, or run `bigclip consolidate` again (its checksum manifest {manifest} records "
        "what was written)"
    )
    folder = file_name.rpartition("/")[0]
    sizes = location.list_files(folder)
    relative = {name: f"{folder}/{name}" if folder else name for name in files}
    for name, record in files.items():
        if sizes.get(name) != record.size:  # a truncated or grown file fails before any read
            raise size_differs(location.child_uri(relative[name]), sizes.get(name), record, advice=advice)
    return {relative[n]: Checked(r, location.child_uri(relative[n]), advice) for n, r in files.items()}
