"""Immutable published checkpoints: `bigclip publish SRC NAME --registry URI`.

A registry is a local folder or an S3 prefix:
  blobs/<sha[:2]>/<sha256>              every file's bytes, stored once by content and shared by
                                        every NAME that holds them (blobs.py)
  checkpoints/NAME/published.json       the manifest, written last and only if absent
  checkpoints/NAME/publishing           present from the start of a publish until it succeeded
  checkpoints/NAME/deleting             present while `rm` runs
  leases/NAME/<id>.json                 runs using NAME (see leases.py)
The manifest maps each file's path to its size and SHA-256 and records the source, the model,
the step, the kind (`dcp`: a bigclip checkpoint; `safetensors`; `torch`: a .pt/.bin file;
`files`) and the entry file that loaders open. It is created with create-if-absent (link(2),
S3 `If-None-Match`), so a NAME is published once and never changes: a new version needs a
new name. Publishing bytes the registry already holds (a second name for the same checkpoint,
a fine-tune sharing frozen files) sends nothing for them; `rm` unpublishes NAME, then sweeps
blobs no other name refers to. Manifests of version 1 (per-name `objects/` folders) still read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from bigclip.checkpoint.integrity import check_object
from bigclip.checkpoint.manifest import MANIFEST_NAME, Manifest
from bigclip.errors import ConfigError, StorageError
from bigclip.registry.blobs import BlobStore, blob_path
from bigclip.registry.leases import HeldLease, break_stale, list_leases, refuse_if_leased
from bigclip.registry.publish_sources import SourceFile, SourceInfo, expand_source
from bigclip.registry.published import (
    PUBLISHED,
    Published,
    check_name,
    detect_kind,
    now,
    parse_registry_ref,
)
from bigclip.storage.locations import open_location
from bigclip.storage.progress import human_bytes, progress_bar
from bigclip.storage.ranged_reads import BlobFolder
from bigclip.storage.records import Inventory, ObjectRecord
from bigclip.weights.safetensors_format import Checked

log = logging.getLogger("bigclip.registry")

__all__ = ["PUBLISHED", "Published", "Registry", "check_name", "parse_registry_ref"]  # what loaders import


class Registry:
    def __init__(self, uri: str) -> None:
        if not uri:
            raise ConfigError(
                "no registry given: pass --registry PATH|s3://bucket/prefix or set BIGCLIP_REGISTRY"
            )
        self.location = open_location(uri)
        self.uri = self.location.uri
        self.blobs = BlobStore(self.location)

    def _folder(self, name: str) -> str:
        return f"checkpoints/{check_name(name)}"

    def blob_key(self, published: Published, sha256: str) -> str:
        """Where the bytes with this hash are stored, relative to the registry."""
        if published.version == 1:
            return f"{self._folder(published.name)}/objects/{sha256}"
        return blob_path(sha256)

    # -- reading ------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every NAME with a folder (published, being published or removed), sorted."""
        return open_location(self.location.child_uri("checkpoints")).list_folders()

    def is_published(self, name: str) -> bool:
        return self.location.exists(f"{self._folder(name)}/{PUBLISHED}")

    def get(self, name: str) -> Published:
        path = f"{self._folder(name)}/{PUBLISHED}"
        if not self.location.exists(path):
            known = [n for n in self.names() if self.is_published(n)]
            raise StorageError(
                f"no checkpoint {name!r} in {self.uri}; published: {', '.join(known) or 'none'}"
            )
        return Published.from_json(
            self.location.read_bytes(path), uri=self.location.child_uri(self._folder(name))
        )

    def published(self) -> list[Published]:
        return [self.get(n) for n in self.names() if self.is_published(n)]

    def blob_folder(self, published: Published, *, root: str | None = None) -> BlobFolder:
        """The publication's files under `root` (default: the entry's folder) by their own names."""
        root = published.root if root is None else root
        prefix = f"{root}/" if root else ""
        names = {
            p[len(prefix) :]: self.blob_key(published, r.sha256)
            for p, r in published.objects.items()
            if p.startswith(prefix)
        }
        return BlobFolder(self.location, "", names=names)

    def damage_advice(self, name: str) -> str:
        """What to do about a damaged blob of NAME (a publication never changes; its blobs can be restored)."""
        return (
            f"delete that blob and publish {name}'s source again under any new name (publish re-sends "
            f"missing blobs, which {name} shares); `bigclip checkpoints verify {name}` lists every damaged file"
        )

    def checked_files(self, published: Published) -> dict[str, Checked]:
        """The records readers check each file of `blob_folder(published)` against."""
        prefix = f"{published.root}/" if published.root else ""
        advice = self.damage_advice(published.name)
        return {
            path[len(prefix) :]: Checked(record, self._where(published, path), advice)
            for path, record in published.objects.items()
            if path.startswith(prefix)
        }

    def _where(self, published: Published, path: str) -> str:
        key = self.blob_key(published, published.objects[path].sha256)
        return f"registry:{published.name} {path} (blob {self.location.child_uri(key)})"

    def size_problems(self, published: Published) -> list[str]:
        """Objects missing or of the wrong size (one listing per blob shard; cheap)."""
        if published.version == 1:
            listing = self.location.list_files(f"{self._folder(published.name)}/objects")
            stored = {sha: listing[sha] for sha in published.blobs() if sha in listing}
        else:
            stored = self.blobs.sizes(published.blobs())
        sizes = {path: stored.get(record.sha256) for path, record in published.objects.items()}
        return published.objects.size_problems(sizes, label=lambda path: self._labelled(published, path))

    def _labelled(self, published: Published, path: str) -> str:
        return f"{path} ({self.blob_key(published, published.objects[path].sha256)})"

    def verify(self, name: str, *, progress: bool = False) -> Published:
        """Re-hash every object; StorageError naming each damaged one."""
        published = self.get(name)
        bar = progress_bar(published.stored_bytes, label=f"verify {name}", enabled=progress)
        blob = {path: self.blob_key(published, record.sha256) for path, record in published.objects.items()}
        problems = published.objects.checksum_problems(
            lambda path: self.location.open_read(blob[path]), label=lambda path: self._labelled(published, path),
            stored_as=blob.__getitem__, read_bytes=bar.update,
        )  # fmt: skip
        bar.close()
        if problems:
            raise StorageError(f"{name} failed verification:\n  " + "\n  ".join(problems))
        return published

    # -- publishing -----------------------------------------------------------------------

    def _check_case(self, name: str) -> None:
        """A name is never two names on a case-insensitive copy of the registry (a macOS or Windows
        disk, an rsync onto one): there NAME and name would share one folder and mix their files."""
        same = [n for n in self.names() if n != name and n.casefold() == name.casefold()]
        if same:
            raise StorageError(
                f"{name} differs from {same[0]} in {self.uri} only in letter case, and a copy of the "
                "registry on a case-insensitive disk would hold both in one folder; publish under another name"
            )

    def publish(self, src: str, name: str, *, model: str = "", progress: bool = False) -> Published:
        folder = self._folder(name)
        if self.is_published(name):
            raise StorageError(
                f"{name} is already published in {self.uri} and never changes; publish under a new name (e.g. {name}-v2)"
            )
        if self.location.exists(f"{folder}/deleting"):
            raise StorageError(
                f"{name} is being removed (or its removal was interrupted: rerun `checkpoints rm {name}`)"
            )
        self._check_case(name)
        info, files = expand_source(src)
        removed = self.blobs.remove_stale_temporaries()
        if removed:
            log.warning("removed %d temporary file(s) an interrupted publish to %s left: %s", len(removed), self.uri,
                        ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else ""))  # fmt: skip
        self.location.write_bytes(f"{folder}/publishing", now().encode())
        intent = self.blobs.intend(owner=f"publish {name}")
        try:
            objects = self._store_all(files, name, progress=progress)
            if not objects:
                raise StorageError(f"{src}: nothing to publish (no files)")
            published = self._describe(name, info, objects, model=model)
            if not self.location.create_exclusive(f"{folder}/{PUBLISHED}", published.to_json()):
                raise StorageError(
                    f"{name} was published by someone else meanwhile; publish under a new name"
                )
        finally:
            intent.release()
        self.location.delete(f"{folder}/publishing")
        log.info("published %s: %d files, %s logical, %s sent", name, len(objects),
                 human_bytes(published.total_bytes), human_bytes(self.blobs.uploaded_bytes))  # fmt: skip
        return self.get(name)

    def _store_all(
        self, files: Iterator[SourceFile], name: str, *, progress: bool
    ) -> dict[str, ObjectRecord]:
        objects: dict[str, ObjectRecord] = {}
        bar = progress_bar(None, label=f"publish {name}", enabled=progress)  # files arrive one by one
        for file in files:
            try:
                if file.local is not None:
                    record = self.blobs.put_local(file.local, file.expected)
                else:
                    record = self.blobs.put_stream(file.stream, file.expected)
            except StorageError as e:
                raise StorageError(f"{file.path}: {e}; nothing was published") from e
            _check_copy(file, record)
            objects[file.path] = record
            bar.update(record.size)
        bar.close()
        return objects

    def _describe(
        self, name: str, info: SourceInfo, objects: dict[str, ObjectRecord], *, model: str
    ) -> Published:
        kind, entry = detect_kind(list(objects))
        published = Published(name=name, kind=kind, entry=entry, objects=Inventory(objects), source=info.uri,
                              model=model or info.model, step=info.step, created=now())  # fmt: skip
        checkpoint_manifest = f"{published.root}/{MANIFEST_NAME}".lstrip("/")
        if (
            kind == "dcp"
            and checkpoint_manifest in objects
            and not (published.model and published.step is not None)
        ):
            key = self.blob_key(published, objects[checkpoint_manifest].sha256)
            data = self.location.read_bytes(key)
            check_object(data, objects[checkpoint_manifest], where=self._where(published, checkpoint_manifest),
                         advice=self.damage_advice(name))  # fmt: skip
            saved = Manifest.from_json(data, uri=key)
            published.model, published.step = published.model or saved.model, saved.step
        return published

    # -- leases and removal ---------------------------------------------------------------

    def acquire_lease(self, name: str, *, owner: str, ttl_s: float = 600.0) -> HeldLease:
        """Declare that `owner` uses NAME until `release()`; fails if NAME is not published."""
        self.get(name)
        held = HeldLease(self.location, check_name(name), owner=owner, ttl_s=ttl_s)
        held.write()
        # Checked after writing the lease: an `rm` that started first is seen here, one that
        # starts later sees the lease (see leases.py).
        if self.location.exists(f"{self._folder(name)}/deleting") or not self.is_published(name):
            held.release()
            raise StorageError(f"{name} is being removed from {self.uri}; use another checkpoint")
        return held.start_renewing()

    def remove(self, name: str, *, break_stale_leases: bool = False) -> int:
        """Delete NAME (published or left incomplete) unless a lease holds it, then sweep the blobs
        no other name holds; returns the bytes freed."""
        folder = self._folder(name)
        if name not in self.names():
            raise StorageError(f"no checkpoint {name!r} in {self.uri}; see `bigclip checkpoints list`")
        self.location.write_bytes(f"{folder}/deleting", now().encode())
        try:
            if break_stale_leases:
                broken, _ = break_stale(self.location, name)
                for lease in broken:
                    log.warning("broke stale lease %s", lease.describe())
            refuse_if_leased(list_leases(self.location, name), name)
        except BaseException:
            self.location.delete(f"{folder}/deleting")
            raise
        freed = sum(self.location.list_files(f"{folder}/objects").values())  # a version-1 publication
        self.location.delete(f"{folder}/{PUBLISHED}")  # unpublished first: never a partial publication
        self.location.delete_folder(folder)
        if not list_leases(self.location, name):
            self.location.delete_folder(f"leases/{name}")
        return freed + self.collect_garbage()

    def collect_garbage(self) -> int:
        """Delete blobs no published NAME refers to (see blobs.py for what is safe); bytes freed."""
        referenced = {sha for p in self.published() for sha in p.blobs()}
        freed, outcome = self.blobs.sweep(referenced)
        if outcome != "swept":
            log.warning("blobs not swept: %s", outcome)
        return freed

    def usage(self) -> tuple[dict[str, int], int]:
        """(bytes only NAME holds, per published NAME; bytes all blobs take)."""
        held = {p.name: p.blobs() for p in self.published()}
        owners: dict[str, int] = {}
        for blobs in held.values():
            for sha in blobs:
                owners[sha] = owners.get(sha, 0) + 1
        unique = {
            name: sum(size for sha, size in blobs.items() if owners[sha] == 1) for name, blobs in held.items()
        }
        stored = {sha: size for blobs in held.values() for sha, size in blobs.items()}
        return unique, sum(stored.values())


def _check_copy(file: SourceFile, record: ObjectRecord) -> None:
    # Bytes that differ from the source manifest's record are refused by BlobStore as it writes them.
    if file.size is not None and record.size != file.size:
        raise StorageError(
            f"{file.path}: read {record.size} bytes, the source announced {file.size}; nothing was published"
        )
