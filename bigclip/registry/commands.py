"""`bigclip publish SRC NAME` and `bigclip checkpoints list|show|verify|rm`: the registry's commands.

bigclip publish SRC NAME                      copy SRC into the registry under an immutable NAME

bigclip checkpoints list                      names, model, step, logical and unique bytes, leases
bigclip checkpoints show NAME                 the manifest: source, files, sizes, leases
bigclip checkpoints verify NAME               re-hash every object (or PATH: a checkpoint folder)
bigclip checkpoints rm NAME [--break-stale-leases]
bigclip checkpoints gc                        delete blobs no published NAME holds (rm does this too)

The options are parsed and checked (a registry given, a local SRC that exists) before the
registry's code, and with it torch, is imported: a bad option fails in a fraction of a second.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from bigclip.cli_args import add_config_flags
from bigclip.config import CheckpointConfig
from bigclip.config.checkpoint import registry_uri
from bigclip.errors import ConfigError, StorageError
from bigclip.registry.git_source import GIT_PREFIX
from bigclip.registry.published import check_name
from bigclip.storage.progress import human_bytes
from bigclip.storage.schemes import is_local, local_path
from bigclip.storage.settings import configure_storage

if TYPE_CHECKING:
    from bigclip.registry.registry import Registry


def add_registry_args(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, CheckpointConfig, ("registry", "s3_endpoint", "s3_region"))
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")


def require_registry(args: argparse.Namespace, *, hint: str = "", exists: bool = True) -> str:
    """The registry's URI; checked here, before the registry's code (and torch) is imported. A
    local one must be a folder, and (`exists`, every command but publish, which makes it) be there:
    a mistyped path would list as an empty registry."""
    uri = registry_uri(args.registry or "")
    if not uri:
        raise ConfigError(
            f"no registry given: pass --registry PATH|s3://bucket/prefix or set BIGCLIP_REGISTRY{hint}"
        )
    path = Path(local_path(uri)).expanduser() if is_local(uri) else None
    if path is not None and path.exists() and not path.is_dir():
        raise ConfigError(f"registry {uri} is a file, not a registry folder; give the registry's folder or an "
                          "s3:// prefix (--registry or BIGCLIP_REGISTRY)")  # fmt: skip
    if path is not None and exists and not path.exists():
        raise ConfigError(f"registry {uri}: no such folder (`bigclip publish` makes one); check --registry or "
                          "BIGCLIP_REGISTRY")  # fmt: skip
    return uri


def open_registry(args: argparse.Namespace, *, exists: bool = True) -> Registry:
    from bigclip.registry.registry import Registry  # torch: only once the options hold

    configure_storage(s3_endpoint=args.s3_endpoint or "", s3_region=args.s3_region or "")
    return Registry(require_registry(args, exists=exists))


def is_path(target: str, *, registry: str = "") -> bool:
    """`checkpoints verify` takes a NAME or a checkpoint folder / run root (a path or URI); without a
    registry, a word naming a local folder is that folder."""
    return "/" in target or target.startswith(".") or (not registry and Path(target).exists())


def check_local_target(target: str) -> None:
    """A local folder `checkpoints verify` can read: one that is missing, or holds no checkpoint, is
    refused saying what to give instead (a run folder points at its checkpoints)."""
    if not is_local(target):
        return
    path = Path(local_path(target)).expanduser()
    give = ("give a checkpoint folder (LOGS/RUN/checkpoints/step_N), a run's checkpoints folder, or a "
            "published NAME with --registry")  # fmt: skip
    if not path.exists():
        raise StorageError(f"{target}: no such folder; {give}")
    if any(path.glob("manifest.json")) or any(path.glob("*/manifest.json")):
        return
    if (path / "checkpoints").is_dir():
        raise StorageError(f"{target} is a run folder: verify {target.rstrip('/')}/checkpoints (its newest "
                           "checkpoint) or one of its checkpoints/step_N folders")  # fmt: skip
    raise StorageError(
        f"{target} holds no committed bigclip checkpoint (no manifest.json in it or its folders); {give}"
    )


def list_command(registry: Registry) -> None:
    """LOGICAL: the files' total size; UNIQUE: bytes no other NAME shares (what `rm` frees)."""
    from bigclip.registry.leases import list_leases

    unique, stored = registry.usage()
    rows = [("NAME", "KIND", "MODEL", "STEP", "LOGICAL", "UNIQUE", "LEASES", "CREATED")]
    logical = 0
    for name in registry.names():
        leases = len(list_leases(registry.location, name))
        if not registry.is_published(name):
            rows.append(
                (name, "(incomplete: no manifest; rerun publish or rm it)", "", "", "", "", str(leases), "")
            )
            continue
        p = registry.get(name)
        logical += p.total_bytes
        step = "" if p.step is None else str(p.step)
        rows.append((name, p.kind, p.model, step, human_bytes(p.total_bytes), human_bytes(unique.get(name, 0)),
                     str(leases), p.created))  # fmt: skip
    if len(rows) == 1:
        print(f"no checkpoints in {registry.uri}")
        return
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(
        f"total: {human_bytes(logical)} logical, {human_bytes(stored)} stored (each distinct file once, by SHA-256)"
    )


def show_command(registry: Registry, name: str) -> None:
    from bigclip.registry.leases import list_leases

    p = registry.get(name)
    print(f"name      {p.name}\nuri       {p.uri}\nkind      {p.kind} (entry: {p.entry or '-'})")
    print(f"model     {p.model or '-'}\nstep      {'-' if p.step is None else p.step}\nsource    {p.source}")
    print(f"created   {p.created}\nfiles     {len(p.objects)}, {human_bytes(p.total_bytes)}")
    print(f"distinct  {human_bytes(p.stored_bytes)} (identical files stored once, shared with other names)")
    for path, record in sorted(p.objects.items()):
        print(f"  {path:<48} {human_bytes(record.size):>12}  sha256:{record.sha256[:16]}")
    leases = list_leases(registry.location, name)
    print(f"leases    {len(leases)}")
    for lease in leases:
        print(f"  {lease.describe()}")


def verify_command(args: argparse.Namespace) -> None:
    target = args.name
    if is_path(target, registry=registry_uri(args.registry or "")):  # a checkpoint folder or run root
        check_local_target(target)  # before torch is imported
        from bigclip.checkpoint.store import CheckpointStore

        configure_storage(s3_endpoint=args.s3_endpoint or "", s3_region=args.s3_region or "")
        parent, _, _ = target.rstrip("/").rpartition("/")
        store = CheckpointStore(parent or ".")
        try:
            manifest = store.verify(target)
        finally:
            store.close()
        print(f"ok: {manifest.uri} ({len(manifest.objects)} objects, {human_bytes(manifest.total_bytes)})")
        return
    p = open_registry(args).verify(target, progress=not args.no_progress)
    print(
        f"ok: {p.name} ({len(set(r.sha256 for r in p.objects.values()))} objects, {human_bytes(p.stored_bytes)})"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bigclip checkpoints", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command, text in (
        ("list", "List published checkpoints."),
        ("show", "Show one checkpoint's manifest and leases."),
        ("verify", "Re-hash every object of NAME (or of a checkpoint PATH)."),
        ("rm", "Remove NAME unless a run holds a lease on it."),
        ("gc", "Delete blobs no published NAME refers to."),
    ):
        sub = commands.add_parser(command, help=text)
        if command not in ("list", "gc"):
            sub.add_argument("name")
        if command == "rm":
            sub.add_argument("--break-stale-leases", action="store_true",
                             help="Delete leases of runs that died (expired, or dead pid on this host).")  # fmt: skip
        add_registry_args(sub)
    args = parser.parse_args(argv)
    if args.command == "verify" and not is_path(args.name, registry=registry_uri(args.registry or "")):
        require_registry(args, hint=f"; to verify a checkpoint folder, give its path (e.g. ./{args.name})")
    elif args.command != "verify":
        require_registry(args)
    if args.command == "verify":
        verify_command(args)
        return 0
    registry = open_registry(args)
    if args.command == "list":
        list_command(registry)
    elif args.command == "show":
        show_command(registry, args.name)
    elif args.command == "rm":
        freed = registry.remove(args.name, break_stale_leases=args.break_stale_leases)
        print(f"removed {args.name} ({human_bytes(freed)} freed; blobs other names hold are kept)")
    elif args.command == "gc":
        print(f"{human_bytes(registry.collect_garbage())} freed")
    return 0


def publish_main(argv: list[str]) -> int:
    """`bigclip publish SRC NAME`."""
    parser = argparse.ArgumentParser(
        prog="bigclip publish", description="Publish an immutable named checkpoint."
    )
    parser.add_argument(
        "src", help="Checkpoint, consolidated file, folder, file, archive, s3:// or http(s):// URI."
    )
    parser.add_argument("name", help="The new, immutable name, e.g. vit-h-14-laion2b-v1.")
    parser.add_argument("--model", default="", help="Model config name to record when SRC does not say.")
    add_registry_args(parser)
    args = parser.parse_args(argv)
    require_registry(args, exists=False)
    check_name(args.name)  # before torch (the registry's import): a misspelt name is said in a moment
    if (
        is_local(args.src)
        and not args.src.startswith(GIT_PREFIX)
        and not Path(local_path(args.src)).expanduser().exists()
    ):
        raise StorageError(f"{args.src}: no such file or folder; give a checkpoint, a weights file, a folder, "
                           "an archive, or an s3://, http(s):// or git+ URI")  # fmt: skip
    registry = open_registry(args, exists=False)
    published = registry.publish(args.src, args.name, model=args.model, progress=not args.no_progress)
    print(f"published {published.name} ({published.kind}, {len(published.objects)} files, "
          f"{human_bytes(published.total_bytes)}, {human_bytes(registry.blobs.uploaded_bytes)} sent) "
          f"-> {published.uri}")  # fmt: skip
    return 0
