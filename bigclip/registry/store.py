"""Immutable published checkpoints: `bigclip publish SRC NAME --registry URI`.

A registry is a local folder or an S3 prefix:
  checkpoints/NAME/objects/<sha256>     every file of the publication, stored by content
  checkpoints/NAME/published.json       the manifest, written last and only if absent
  checkpoints/NAME/deleting             present while `rm` runs
  leases/NAME/<id>.json                 runs using NAME (see leases.py)
The manifest maps each file's path to its size and SHA-256 and records the source, the model,
the step, the kind (`dcp`: a bigclip checkpoint; `safetensors`; `torch`: a .pt/.bin file;
`files`) and the entry file that loaders open. It is created with create-if-absent (link(2),
S3 `If-None-Match`), so a NAME is published once and never changes: a new version needs a
new name. Objects named by their hash cannot change either without `verify` noticing.
An interrupted publish leaves objects but no manifest; publishing the same NAME again reuses
the objects already stored (their hashes are known from the source's manifest, when it has one).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import secrets
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from bigclip.checkpoint.manifest import MANIFEST_NAME, Manifest
from bigclip.errors import ConfigError, StorageError
from bigclip.registry.leases import HeldLease, break_stale, list_leases, refuse_if_leased
from bigclip.registry.sources import SourceFile, SourceInfo, expand_source
from bigclip.storage.blobs import BlobFolder
from bigclip.storage.hashing import ObjectRecord, sha256_of_stream
from bigclip.storage.locations import LocalLocation, open_location
from bigclip.storage.progress import human_bytes, progress_bar
from bigclip.storage.s3 import S3Settings, boto3_client, is_s3, split_s3_uri
from bigclip.storage.sinks import create_exclusive, open_sink
from bigclip.weights.sources import REGISTRY_SCHEME

log = logging.getLogger("bigclip.registry")

PUBLISHED = "published.json"
FORMAT = "bigclip-published"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass
class Published:
    name: str
    kind: str  # dcp | safetensors | torch | files
    entry: str  # the file a loader opens ('' for kind files)
    objects: dict[str, ObjectRecord]
    source: str = ""
    model: str = ""
    step: int | None = None
    created: str = ""
    uri: str = field(default="", compare=False)  # where it was read from; not stored

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.objects.values())

    @property
    def stored_bytes(self) -> int:
        """Storage used: identical files are stored once."""
        return sum({r.sha256: r.size for r in self.objects.values()}.values())

    @property
    def root(self) -> str:
        """The folder of the entry file, inside the publication."""
        return self.entry.rpartition("/")[0]

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "version": 1, **asdict(self)}
        body.pop("uri")
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, uri: str) -> Published:
        try:
            body = json.loads(data)
            if body.pop("format", None) != FORMAT:
                raise ValueError("not a publication manifest")
            body.pop("version", None)
            body["objects"] = {p: ObjectRecord(**r) for p, r in body["objects"].items()}
            return cls(**body, uri=uri)
        except (ValueError, KeyError, TypeError) as e:
            raise StorageError(f"{uri}: unreadable publication manifest ({e})") from e


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"invalid checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (at most 128, "
            "starting with a letter or digit), e.g. vit-h-14-laion2b-v1"
        )
    return name


class Registry:
    def __init__(self, uri: str, *, s3: S3Settings | None = None) -> None:
        if not uri:
            raise ConfigError(
                "no registry given: pass --registry PATH|s3://bucket/prefix or set BIGCLIP_REGISTRY"
            )
        self.s3 = s3
        self.location = open_location(uri, s3=s3)
        self.uri = self.location.uri

    def _folder(self, name: str) -> str:
        return f"checkpoints/{check_name(name)}"

    # -- reading ------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every NAME with a folder (published or not), sorted."""
        return open_location(self.location.child_uri("checkpoints"), s3=self.s3).list_folders()

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

    def blob_folder(self, published: Published, *, root: str | None = None) -> BlobFolder:
        """The publication's files under `root` (default: the entry's folder) by their own names."""
        root = published.root if root is None else root
        prefix = f"{root}/" if root else ""
        names = {p[len(prefix) :]: r.sha256 for p, r in published.objects.items() if p.startswith(prefix)}
        return BlobFolder(self.location, f"{self._folder(published.name)}/objects", names=names)

    def size_problems(self, published: Published) -> list[str]:
        """Objects missing or of the wrong size (one listing; cheap)."""
        stored = self.location.list_files(f"{self._folder(published.name)}/objects")
        problems = []
        for path, record in published.objects.items():
            size = stored.get(record.sha256)
            if size != record.size:
                state = "missing" if size is None else f"{size} bytes, manifest says {record.size}"
                problems.append(f"{path} (objects/{record.sha256}): {state}")
        return problems

    def verify(self, name: str, *, progress: bool = False) -> Published:
        """Re-hash every object; StorageError naming each damaged one."""
        published = self.get(name)
        bar = progress_bar(published.stored_bytes, label=f"verify {name}", enabled=progress)
        problems, seen = [], set()
        for path, record in published.objects.items():
            if record.sha256 in seen:
                continue
            seen.add(record.sha256)
            key = f"{self._folder(name)}/objects/{record.sha256}"
            try:
                with self.location.open_read(key) as stream:
                    actual = sha256_of_stream(stream)
            except Exception as e:  # missing or unreadable: reported with the rest
                problems.append(f"{path} (objects/{record.sha256}): cannot read ({e})")
                continue
            bar.update(actual.size)
            if actual != record:
                problems.append(
                    f"{path} (objects/{record.sha256}): size {actual.size}, sha256 {actual.sha256} differs"
                )
        bar.close()
        if problems:
            raise StorageError(f"{name} failed verification:\n  " + "\n  ".join(problems))
        return published

    # -- publishing -----------------------------------------------------------------------

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
        info, files = expand_source(src, s3=self.s3)
        objects: dict[str, ObjectRecord] = {}
        stored = self.location.list_files(f"{folder}/objects")  # left by an interrupted publish
        bar = progress_bar(None, label=f"publish {name}", enabled=progress)  # files arrive one by one
        for file in files:
            objects[file.path] = self._store(folder, file, bar, stored=stored)
        bar.close()
        if not objects:
            raise StorageError(f"{src}: nothing to publish (no files)")
        published = self._describe(name, info, objects, model=model)
        if not create_exclusive(self.location, f"{folder}/{PUBLISHED}", published.to_json()):
            raise StorageError(f"{name} was published by someone else meanwhile; publish under a new name")
        log.info("published %s: %d files, %s", name, len(objects), human_bytes(published.stored_bytes))
        return self.get(name)

    def _store(self, folder: str, file: SourceFile, bar: tqdm, *, stored: dict[str, int]) -> ObjectRecord:
        expected = file.expected
        if expected and stored.get(expected.sha256) == expected.size:
            bar.update(expected.size)
            return expected  # stored by an earlier, interrupted publish of this NAME (or a twin file)
        key = expected.sha256 if expected else f".staging-{secrets.token_hex(8)}"
        sink = open_sink(self.location, f"{folder}/objects/{key}", overwrite=True)
        try:
            while chunk := file.stream.read(16 << 20):
                sink.write(chunk)
                bar.update(len(chunk))
            record = sink.record()
            _check_copy(file, record)
        except BaseException:
            sink.abort()
            raise
        sink.commit()
        if not expected:
            self._promote(f"{folder}/objects/{key}", f"{folder}/objects/{record.sha256}")
        stored[record.sha256] = record.size
        return record

    def _promote(self, staging: str, final: str) -> None:
        """Give a staged object its content address (a rename locally, a server-side copy on S3)."""
        if isinstance(self.location, LocalLocation):
            (self.location.root / staging).replace(self.location.root / final)
            return
        if is_s3(self.location.uri):
            bucket, src_key = split_s3_uri(self.location.child_uri(staging))
            _, dst_key = split_s3_uri(self.location.child_uri(final))
            boto3_client(self.location.settings).copy({"Bucket": bucket, "Key": src_key}, bucket, dst_key)
            self.location.delete(staging)

    def _describe(
        self, name: str, info: SourceInfo, objects: dict[str, ObjectRecord], *, model: str
    ) -> Published:
        kind, entry = detect_kind(list(objects))
        published = Published(name=name, kind=kind, entry=entry, objects=objects, source=info.uri,
                              model=model or info.model, step=info.step, created=_now())  # fmt: skip
        checkpoint_manifest = f"{published.root}/{MANIFEST_NAME}".lstrip("/")
        if (
            kind == "dcp"
            and checkpoint_manifest in objects
            and not (published.model and published.step is not None)
        ):
            key = f"{self._folder(name)}/objects/{objects[checkpoint_manifest].sha256}"
            saved = Manifest.from_json(self.location.read_bytes(key), uri=key)
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
        """Delete NAME (published or left incomplete) unless a lease holds it; returns bytes freed."""
        folder = self._folder(name)
        if name not in self.names():
            raise StorageError(f"no checkpoint {name!r} in {self.uri}; see `bigclip checkpoints list`")
        self.location.write_bytes(f"{folder}/deleting", _now().encode())
        try:
            if break_stale_leases:
                broken, _ = break_stale(self.location, name)
                for lease in broken:
                    log.warning("broke stale lease %s", lease.describe())
            refuse_if_leased(list_leases(self.location, name), name)
        except BaseException:
            self.location.delete(f"{folder}/deleting")
            raise
        freed = sum(self.location.list_files(f"{folder}/objects").values())
        self.location.delete(f"{folder}/{PUBLISHED}")  # unpublished first: never a partial publication
        self.location.delete_folder(f"{folder}/objects")
        self.location.delete_folder(folder)
        if not list_leases(self.location, name):
            self.location.delete_folder(f"leases/{name}")
        return freed


def _check_copy(file: SourceFile, record: ObjectRecord) -> None:
    if file.expected and record != file.expected:
        raise StorageError(
            f"{file.path}: the source object is damaged (size {record.size}, sha256 {record.sha256[:12]}..., "
            f"its manifest says size {file.expected.size}, sha256 {file.expected.sha256[:12]}...); nothing was published"
        )
    if file.size is not None and record.size != file.size:
        raise StorageError(
            f"{file.path}: read {record.size} bytes, the source announced {file.size}; nothing was published"
        )


def detect_kind(paths: list[str]) -> tuple[str, str]:
    """(kind, entry) of a publication from its file paths (shallowest match wins)."""
    by_depth = sorted(paths, key=lambda p: (p.count("/"), p))
    for kind, test in (
        ("dcp", lambda p: p.rpartition("/")[2] == ".metadata"),
        ("safetensors", lambda p: p.endswith(".safetensors.index.json")),
        ("safetensors", lambda p: p.endswith(".safetensors")),
        ("torch", lambda p: p.endswith(_TORCH_SUFFIXES)),
    ):
        found = [p for p in by_depth if test(p)]
        if len(found) == 1 or (found and kind == "dcp"):
            return kind, found[0]
    return "files", ""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def parse_registry_ref(uri: str) -> str | None:
    """'registry:NAME' -> NAME; anything else -> None."""
    return check_name(uri[len(REGISTRY_SCHEME) :]) if uri.startswith(REGISTRY_SCHEME) else None
