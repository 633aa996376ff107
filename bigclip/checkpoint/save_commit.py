"""The commit of a rank-local save: `.metadata` from every rank's piece, then the manifest.

After every rank wrote its shards and record (rank_local_save.py), one gather brings rank 0 each
rank's outcome (an error, or the digests of its keys and of its `.metadata` piece, and the
size and SHA-256 of every object it wrote). Rank 0 asks only for the pieces it does not hold
already: a piece changes only when a rank's chunks or their places in its files do, so after
the first save of a run no piece crosses the network (DCP's plan caching, without the plans).
Rank 0 then writes `.metadata` (assembled from the pieces: metadata_stream.py) and, last, the
manifest: no manifest, no checkpoint. Rank 0's work is O(world) joins and the manifest's
object list; nothing is pickled or unpickled per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bigclip.checkpoint import metadata_stream
from bigclip.checkpoint.coordination import CheckpointGroup
from bigclip.checkpoint.dcp_errors import summarize_failures
from bigclip.checkpoint.manifest import MANIFEST_NAME, RANK_RECORDS, Manifest
from bigclip.checkpoint.rank_local_save import RankSave
from bigclip.storage.access_checks import explain_error
from bigclip.storage.hashing import HashingFileSystem
from bigclip.storage.locations import Location
from bigclip.storage.rank_prefixes import rule_of

METADATA_NAME = ".metadata"


@dataclass
class PieceCache:
    """Rank 0's copy of every rank's last `.metadata` piece, by digest."""

    digests: list[str] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)

    def missing(self, digests: list[str]) -> list[int]:
        if len(self.digests) != len(digests):
            self.digests, self.pieces = [""] * len(digests), [b""] * len(digests)
        return [rank for rank, digest in enumerate(digests) if self.digests[rank] != digest]

    def update(self, digests: list[str], pieces: list[bytes | None]) -> None:
        for rank, piece in enumerate(pieces):
            if piece is not None:
                self.digests[rank], self.pieces[rank] = digests[rank], piece


@dataclass
class Outcome:
    """One rank's report after writing (picklable: it is gathered)."""

    error: str | None
    keys_digest: str = ""
    piece_digest: str = ""
    records: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)


def outcome(written: RankSave | None, error: str | None, hashing: HashingFileSystem) -> Outcome:
    if written is None:
        return Outcome(error=error or "its write failed", failures=hashing.failures())
    return Outcome(None, written.keys_digest, written.piece_digest, hashing.records(), hashing.failures())


def commit(
    group: CheckpointGroup,
    *,
    location: Location,
    folder: str,
    writer: Any,
    hashing: HashingFileSystem,
    written: RankSave | None,
    mine: Outcome,
    cache: PieceCache,
    manifest: dict[str, Any],
) -> tuple[str | None, Manifest | None]:
    """Collective. (error, the manifest written on rank 0); `manifest`: step, world size, meta."""
    reports = group.gather(mine)
    plan = _plan(reports, cache) if group.rank == 0 else None
    error, needed = group.broadcast(plan)
    if error:
        return error, None
    pieces = group.gather(written.piece if written is not None and group.rank in needed else None)
    if group.rank != 0:
        return group.broadcast(None), None
    cache.update([r.piece_digest for r in reports], pieces)
    error, built = _write(location, folder, writer, hashing, written, cache, reports, manifest)
    return group.broadcast(error), built


def _plan(reports: list[Outcome], cache: PieceCache) -> tuple[str | None, list[int]]:
    failed = [
        f"rank {r}: {name}: {why}"
        for r, report in enumerate(reports)
        for name, why in report.failures.items()
    ]
    if failed:
        return summarize_failures(failed), []
    errors = [(r, report.error) for r, report in enumerate(reports) if report.error]
    if errors:
        rank, why = errors[0]
        more = f" (and {len(errors) - 1} more ranks)" if len(errors) > 1 else ""
        return f"rank {rank}: {why}{more}", []
    if len({report.keys_digest for report in reports}) > 1:
        odd = [r for r, report in enumerate(reports) if report.keys_digest != reports[0].keys_digest]
        return f"ranks {odd[:5]} save other keys than rank 0 (every rank must pass the same state keys)", []
    return None, cache.missing([report.piece_digest for report in reports])


def _write(
    location: Location,
    folder: str,
    writer: Any,
    hashing: HashingFileSystem,
    written: RankSave,
    cache: PieceCache,
    reports: list[Outcome],
    manifest: dict[str, Any],
) -> tuple[str | None, Manifest | None]:
    """Rank 0: `.metadata`, then the manifest listing every rank's objects and `.metadata`."""
    try:
        data = metadata_stream.assemble(written.head, cache.pieces)
        with writer.fs.create_stream(writer.fs.concat_path(writer.path, METADATA_NAME), "wb") as stream:
            stream.write(data)
    except Exception as e:  # reported to every rank by the caller
        return f"writing {METADATA_NAME} failed: {explain_error(e)}", None
    objects = {name: rec for report in reports for name, rec in report.records.items()}
    objects.update(hashing.records())  # rank 0's, now with .metadata
    built = Manifest.build(objects=objects, layout=RANK_RECORDS, prefixes=rule_of(writer), **manifest)
    try:
        location.write_bytes(f"{folder}/{MANIFEST_NAME}", built.to_json())
    except Exception as e:
        return f"writing the manifest failed: {explain_error(e)}", None
    return None, built
