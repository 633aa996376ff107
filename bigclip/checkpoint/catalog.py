"""Which checkpoints a root holds, which are committed, and which retention may delete.

One folder per save, `step_00001200/` (on S3 each rank's objects in a sub-folder of it, see
storage/s3_dcp_writer.py; whatever lists, sizes, copies or deletes a checkpoint takes every
object under the folder); committed when it holds `manifest.json`. Listing
costs one LIST (or readdir) plus one HEAD (or stat) per folder examined, newest first.
Retention keeps the newest K committed checkpoints (never fewer than one) and deletes
older committed ones and interrupted saves older than the newest commit; folders newer
than the newest commit may be saves in flight and are left alone, and so are committed
ones a `keep` predicate still needs (the remote mirror's backlog: `mirror.py`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from bigclip.checkpoint.manifest import MANIFEST_NAME, Manifest
from bigclip.config import CheckpointConfig
from bigclip.errors import StorageError
from bigclip.storage.locations import Location
from bigclip.storage.schemes import is_local

log = logging.getLogger("bigclip.checkpoint")

_FOLDER = re.compile(r"^step_(\d+)$")


def step_folder(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must not be negative, got {step}")
    return f"step_{step:08d}"


@dataclass(frozen=True)
class Entry:
    step: int
    folder: str
    committed: bool


def step_of(folder: str) -> int | None:
    """The step of a `step_N` folder (None for any other name)."""
    match = _FOLDER.match(folder)
    return int(match.group(1)) if match else None


def _steps(location: Location) -> list[tuple[int, str]]:
    """(step, folder) of every step folder under the root, newest first (one listing)."""
    found = [(int(m.group(1)), name) for name in location.list_folders() if (m := _FOLDER.match(name))]
    return sorted(found, reverse=True)


def entries(location: Location) -> list[Entry]:
    """Every step folder under the root, newest first, with its commit state."""
    return [Entry(step, name, location.exists(f"{name}/{MANIFEST_NAME}")) for step, name in _steps(location)]


def latest_committed(location: Location) -> Entry | None:
    # Lazy: the newest folders first, so usually one HEAD, not one per folder.
    for step, name in _steps(location):
        if location.exists(f"{name}/{MANIFEST_NAME}"):
            return Entry(step, name, True)
    return None


def read_manifest(location: Location, folder: str) -> Manifest:
    try:
        data = location.read_bytes(f"{folder}/{MANIFEST_NAME}")
    except IsADirectoryError:
        raise StorageError(
            f"{location.child_uri(folder)}: its {MANIFEST_NAME} is a folder, not a manifest"
        ) from None
    return Manifest.from_json(data, uri=location.child_uri(folder))


def folders_to_delete(
    all_entries: list[Entry], *, keep_last: int, keep: Callable[[Entry], bool] | None = None
) -> list[Entry]:
    committed = [e for e in all_entries if e.committed]
    if not committed:
        return []
    kept = {e.folder for e in committed[: max(1, keep_last)]}
    newest = committed[0].step
    return [
        e
        for e in all_entries
        if e.folder not in kept
        and (e.committed or e.step < newest)
        and not (keep and e.committed and keep(e))
    ]


def apply_retention(
    location: Location, *, keep_last: int, keep: Callable[[Entry], bool] | None = None
) -> list[str]:
    """Delete what retention allows (see module docstring); returns the deleted folders' URIs."""
    if keep_last <= 0:
        return []
    return [
        delete_checkpoint(location, e)
        for e in folders_to_delete(entries(location), keep_last=keep_last, keep=keep)
    ]


def delete_checkpoint(location: Location, entry: Entry) -> str:
    """Delete one checkpoint folder; returns its URI."""
    if entry.committed:
        # Uncommit first, so a deletion cut short never leaves a committed, partial folder.
        location.delete(f"{entry.folder}/{MANIFEST_NAME}")
    location.delete_folder(entry.folder)
    uri = location.child_uri(entry.folder)
    log.info("deleted %s checkpoint %s", "committed" if entry.committed else "partial", uri)
    return uri


def clear_folder(location: Location, folder: str) -> None:
    """Empty a step folder before saving into it again (manifest first: it stops being committed).
    One listing says both whether it is committed and whether anything is there (a save's usual
    case: nothing, one request)."""
    files = location.list_files(folder)
    if MANIFEST_NAME in files:
        log.warning("overwriting committed checkpoint %s", location.child_uri(folder))
        location.delete(f"{folder}/{MANIFEST_NAME}")
    if files:
        location.delete_folder(folder)


def keep_last_for(cfg: CheckpointConfig, root: str) -> int:
    """Retention for a root: --remote-keep-last in an object store; --keep-last (or 1 with
    --delete-previous-checkpoint) locally; 0 keeps everything."""
    if not is_local(root):
        return cfg.remote_keep_last
    return 1 if cfg.delete_previous_checkpoint else cfg.keep_last
