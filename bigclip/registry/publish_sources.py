"""What `bigclip publish SRC` copies: SRC expanded into files, each read once, in order.

SRC may be
  - a bigclip checkpoint (a committed step folder, or a run's checkpoint root: its newest
    commit), local or S3: its manifest's objects plus the manifest, with their recorded sizes
    and SHA-256, so a damaged source object is caught while it is copied;
  - a consolidated file (`X.safetensors` with `X.manifest.json` beside it): the files that
    manifest lists, plus the manifest;
  - any other local file or folder (walked recursively), an object in a store (`s3://`...), a
    prefix written with a trailing `/` (copied whole), or a file a web server serves (`http(s)://`);
  - the same from any fsspec filesystem (`gs://`, `az://`, `hf://`, `memory://`, `file://`...)
    whose package is installed (a missing one is named), registered as a scheme or not;
  - a git repository at a ref, `git+https://host/repo.git@v1.0` or `git+file:///srv/repo@main`,
    optionally `#sub/folder` (cloned through the git CLI: git_source.py);
  - an archive (`.tar`, `.tar.gz`, `.tgz`, `.tar.bz2`, `.tar.xz`, `.zip`) from any of those,
    extracted on the fly (tar streams; zip needs random access, so a remote zip is spooled to
    a temporary file first).
Paths inside archives are checked: absolute paths and `..` are refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from bigclip.checkpoint import catalog
from bigclip.checkpoint.manifest import MANIFEST_NAME
from bigclip.errors import StorageError
from bigclip.registry.git_source import GIT_PREFIX, git_source
from bigclip.storage.locations import LocalLocation, Location, open_location, open_parent
from bigclip.storage.records import ObjectRecord
from bigclip.storage.redact import redact_text
from bigclip.weights.output_manifest import manifest_beside

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
ARCHIVE_SUFFIXES = (*TAR_SUFFIXES, ".zip")


@dataclass
class SourceFile:
    path: str  # where it goes inside the publication
    stream: BinaryIO  # consume before asking for the next file
    size: int | None = None
    expected: ObjectRecord | None = None  # from the source's own manifest
    local: Path | None = None  # a local file: hashed before anything is sent (registry/blobs.py)


@dataclass
class SourceInfo:
    uri: str
    model: str = ""
    step: int | None = None


def expand_source(src: str) -> tuple[SourceInfo, Iterator[SourceFile]]:
    if src.startswith(GIT_PREFIX):
        return git_source(src, expand=_local_source)
    location = open_location(src.rstrip("/") or "/", any_scheme=True)
    if isinstance(location, LocalLocation):
        if not location.root.exists():
            raise StorageError(f"{src}: no such file or folder")
        return _local_source(location.root)
    if not location.listable:  # a web server's file: downloaded as it is sent
        return SourceInfo(redact_text(src)), _download_files(*open_parent(src))
    return _remote_source(src, location)


def _local_source(path: Path) -> tuple[SourceInfo, Iterator[SourceFile]]:
    return _folder_source(path) if path.is_dir() else _file_source(path)


# -- bigclip checkpoints and consolidated files ----------------------------------------------


def _checkpoint_folder(location: Location) -> tuple[Location, str] | None:
    """(parent, folder) of a committed checkpoint at `location`, or of a run root's newest one."""
    if location.exists(MANIFEST_NAME):
        return open_parent(location.uri, any_scheme=True)
    entry = catalog.latest_committed(location)
    return (location, entry.folder) if entry else None


def _checkpoint_files(parent: Location, folder: str) -> tuple[SourceInfo, Iterator[SourceFile]]:
    manifest = catalog.read_manifest(parent, folder)
    info = SourceInfo(manifest.uri, manifest.model, manifest.step)

    def files() -> Iterator[SourceFile]:
        for name, record in manifest.objects.items():
            with parent.open_read(f"{folder}/{name}") as stream:
                yield SourceFile(name, stream, record.size, record, local=_local(parent, f"{folder}/{name}"))
        yield _bytes_file(MANIFEST_NAME, parent.read_bytes(f"{folder}/{MANIFEST_NAME}"))

    return info, files()


def _consolidated_files(location: Location, manifest_name: str) -> tuple[SourceInfo, Iterator[SourceFile]]:
    raw = location.read_bytes(manifest_name)
    body = json.loads(raw)
    info = SourceInfo(location.child_uri(manifest_name), body.get("model", ""), body.get("step"))

    def files() -> Iterator[SourceFile]:
        for name, record in body["files"].items():
            with location.open_read(name) as stream:
                yield SourceFile(
                    name, stream, record["size"], ObjectRecord(**record), local=_local(location, name)
                )
        yield _bytes_file(manifest_name, raw)

    return info, files()


def _bytes_file(path: str, data: bytes) -> SourceFile:
    """A small file already in memory: its hash is known before anything is sent."""
    return SourceFile(
        path, io.BytesIO(data), len(data), ObjectRecord(len(data), hashlib.sha256(data).hexdigest())
    )


def _local(location: Location, relative: str) -> Path | None:
    return Path(location.root) / relative if isinstance(location, LocalLocation) else None


# -- local -------------------------------------------------------------------------------


def _folder_source(path: Path) -> tuple[SourceInfo, Iterator[SourceFile]]:
    found = _checkpoint_folder(open_location(str(path)))
    if found:
        return _checkpoint_files(*found)
    return SourceInfo(str(path.absolute())), _walk(path)


def _walk(root: Path) -> Iterator[SourceFile]:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb") as stream:
            yield SourceFile(path.relative_to(root).as_posix(), stream, path.stat().st_size, local=path)


def _file_source(path: Path) -> tuple[SourceInfo, Iterator[SourceFile]]:
    location = open_location(str(path.parent))
    manifest = manifest_beside(location, path.name)
    if manifest:
        return _consolidated_files(location, manifest)
    info = SourceInfo(str(path.absolute()))
    if path.name.endswith(ARCHIVE_SUFFIXES):
        return info, _archive_files(path.name, open(path, "rb"), local_path=path)
    return info, _single(path.name, lambda: open(path, "rb"), path.stat().st_size, local=path)


def _single(name: str, opener, size: int | None, *, local: Path | None = None) -> Iterator[SourceFile]:  # noqa: ANN001
    with opener() as stream:
        yield SourceFile(name, stream, size, local=local)


# -- object stores, fsspec filesystems and web servers -----------------------------------------


def _remote_source(src: str, location: Location) -> tuple[SourceInfo, Iterator[SourceFile]]:
    if src.endswith("/"):
        found = _checkpoint_folder(location)
        if found:
            return _checkpoint_files(*found)
        return SourceInfo(src), _prefix_files(location)
    parent, name = open_parent(src, any_scheme=True)
    if parent.exists(name):
        manifest = manifest_beside(parent, name)
        if manifest:
            return _consolidated_files(parent, manifest)
        if name.endswith(ARCHIVE_SUFFIXES):
            return SourceInfo(src), _archive_files(name, parent.open_read(name))
        return SourceInfo(src), _single(name, lambda: parent.open_read(name), None)
    found = _checkpoint_folder(location)
    if found:
        return _checkpoint_files(*found)
    raise StorageError(f"{src}: no such object (to copy a whole prefix, end the URI with '/')")


def _prefix_files(location: Location) -> Iterator[SourceFile]:
    files = location.list_files("")
    if not files:
        raise StorageError(f"{location.uri}/ holds no objects")
    for name, size in sorted(files.items()):
        with location.open_read(name) as stream:
            yield SourceFile(name, stream, size)


def _download_files(parent: Location, leaf: str) -> Iterator[SourceFile]:
    name = leaf.split("?")[0].split("#")[0] or "download"  # a URL's query is not part of the name
    response = parent.open_read(leaf)
    with response:
        if name.endswith(ARCHIVE_SUFFIXES):
            yield from _archive_files(name, response)
        else:
            yield SourceFile(name, response, getattr(response, "length", None))


# -- archives ------------------------------------------------------------------------------


def _archive_files(name: str, stream: BinaryIO, *, local_path: Path | None = None) -> Iterator[SourceFile]:
    with stream:
        if name.endswith(".zip"):
            yield from _zip_files(name, stream, local_path)
            return
        try:
            with tarfile.open(fileobj=stream, mode="r|*") as archive:
                for member in archive:
                    if member.isfile():
                        yield SourceFile(
                            _safe_path(member.name, name), archive.extractfile(member), member.size
                        )
        except tarfile.TarError as e:
            raise StorageError(f"{name}: not a readable tar archive ({e})") from e


def _zip_files(name: str, stream: BinaryIO, local_path: Path | None) -> Iterator[SourceFile]:
    with tempfile.TemporaryFile() if local_path is None else open(local_path, "rb") as seekable:
        if local_path is None:
            shutil.copyfileobj(stream, seekable, 16 << 20)
        try:
            archive = zipfile.ZipFile(seekable)
        except zipfile.BadZipFile as e:
            raise StorageError(f"{name}: not a readable zip archive ({e})") from e
        for member in archive.infolist():
            if not member.is_dir():
                with archive.open(member) as entry:
                    yield SourceFile(_safe_path(member.filename, name), entry, member.file_size)


def _safe_path(path: str, archive: str) -> str:
    posix = path.replace("\\", "/")
    clean = posixpath.normpath(posix)
    if posix.startswith("/") or clean in (".", "") or clean == ".." or clean.startswith("../"):
        raise StorageError(f"{archive}: refusing entry {path!r} (absolute or outside the archive)")
    return clean
