"""Which committed checkpoint a load means, and whether its inventory is whole (rank 0 only).

`which` is "latest" (the newest commit under the store's root), a checkpoint's path or URI, a
folder name under the root, or another run's checkpoint root (its newest commit). With
`fall_back` (what `--resume latest` asks for) the older commits of the same root follow as
candidates, newest first, so a damaged one can be skipped; an explicit checkpoint has none.
The cheap checks (manifest readable, every object there with its size) run here; the bytes are
checked as they are loaded (verified_reader.py).
"""

from __future__ import annotations

from bigclip.checkpoint import catalog
from bigclip.checkpoint.manifest import MANIFEST_NAME, Manifest
from bigclip.errors import StorageError
from bigclip.storage.locations import Location, open_location, open_parent
from bigclip.storage.records import Inventory

LATEST = "latest"


def candidates(root: Location, which: str, *, fall_back: bool) -> tuple[str, list[str]]:
    """(root URI, checkpoint folders to try in order): the one `which` names, then with
    `fall_back` every older commit under its root. Plain data: it is broadcast to every rank."""
    location, folder = resolve(root, which)
    if not fall_back:
        return location.uri, [folder]
    step = catalog.step_of(folder)
    older = [e.folder for e in catalog.entries(location) if e.committed and e.folder != folder]
    return location.uri, [folder, *(f for f in older if step is None or catalog.step_of(f) < step)]


def resolve(root: Location, which: str) -> tuple[Location, str]:
    if which == LATEST:
        return root, latest_folder(root)
    if "/" not in which and root.exists(f"{which}/{MANIFEST_NAME}"):
        return root, which  # a folder name under this store's root, e.g. step_00001200
    parent, name = open_parent(which, any_scheme=True)
    if parent.exists(f"{name}/{MANIFEST_NAME}"):
        return parent, name
    as_root = open_location(which, any_scheme=True)
    if catalog.entries(as_root):  # a run's checkpoint root: take its newest commit
        return as_root, latest_folder(as_root)
    raise StorageError(_not_a_checkpoint(root, which, parent, name, as_root))


def _not_a_checkpoint(root: Location, which: str, parent: Location, name: str, as_root: Location) -> str:
    """Why `which` names no checkpoint, with what to give instead."""
    if parent.exists(MANIFEST_NAME):
        return f"{which} is a file inside the checkpoint {parent.uri}: give that folder"
    run_checkpoints = open_location(as_root.child_uri("checkpoints"), any_scheme=True)
    in_run = [e.folder for e in catalog.entries(run_checkpoints) if e.committed]  # newest first
    if in_run:
        return (f"{which} is a run folder: give its checkpoints folder {run_checkpoints.uri} (its newest commit, "
                f"{in_run[0]}) or one of its checkpoints ({', '.join(in_run[:3])})")  # fmt: skip
    missing = not parent.exists(name) and not as_root.list_folders() and not as_root.list_files("")
    entries = catalog.entries(
        parent
    )  # listed once: the checkpoints folder the path points into, if it is one
    near, entries = (parent, entries) if entries else (root, catalog.entries(root))
    committed = [near.child_uri(e.folder) for e in entries if e.committed]
    if missing:
        why = f"{which}: nothing is there (no such checkpoint, file or folder)"
        if not committed:
            return f"{why}; check the path"
    else:
        why = f"{which} is not a committed checkpoint (no {MANIFEST_NAME}; an interrupted save is never resumed from)"
    return f"{why}. Committed ones under {near.uri}: {committed[:5] or 'none'}"


def latest_folder(location: Location) -> str:
    entry = catalog.latest_committed(location)
    if entry is None:
        raise StorageError(f"no committed checkpoint under {location.uri}; start without --resume")
    return entry.folder


def inspect(location: Location, folder: str) -> Manifest | str:
    """The checkpoint's manifest when its inventory is whole, else why not (one line)."""
    try:
        manifest = catalog.read_manifest(location, folder)
    except StorageError as e:
        return f"{location.child_uri(folder)}/{MANIFEST_NAME} is damaged: {e}"
    named = catalog.step_of(folder.rstrip("/").rsplit("/", 1)[-1])
    if named is not None and named != manifest.step:  # a folder renamed: `latest` orders by the name
        return (f"checkpoint {manifest.uri} holds step {manifest.step}, not the step its folder is named for "
                f"({named}): a renamed or mixed-up copy; give it its own name (step_{manifest.step:08d})")  # fmt: skip
    problems = manifest.objects.size_problems(location.list_files(folder))
    if problems:
        return f"checkpoint {manifest.uri} is damaged: " + "; ".join(problems)
    return manifest


def summary(found: Manifest | str) -> Manifest | str:
    """What every rank needs of a manifest (it is broadcast): all but the object list, which grows
    with the world size; `.metadata`'s record stays, for checkpoints read through it."""
    if isinstance(found, str):
        return found
    kept = Inventory((name, rec) for name, rec in found.objects.items() if name == ".metadata")
    return Manifest(**{**found.__dict__, "objects": kept})
