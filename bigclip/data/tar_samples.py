"""Webdataset samples from one tar shard, each with the cursor just after it.

A webdataset shard is a tar whose consecutive members sharing a key form a sample
(`0001.jpg`, `0001.txt` -> key '0001'; the key is the path up to the first dot of the
file name, webdataset's `base_plus_ext`). Reading is our own rather than webdataset's
iterators because exact resume needs, for every sample, where the *next* one starts: a
`Cursor` (sample index, tar byte offset). A resumed reader seeks (local) or issues a ranged
GET (object stores) straight to that byte. Compressed shards (.tar.gz, .tgz) cannot be entered
mid-stream; they are re-read from the start and the first `index` samples skipped.

A reader may also read a *piece* of a shard: samples [start.index, stop). A piece that starts
where no byte offset is known (a shard split between ranks, see resume/assignment.py) is read
from the shard's start, the samples before it passed over without reading their data.

A truncated or unreadable shard is not an error: the reader stops, `error` says why, and
the samples read before the damage are kept (the loader counts and names such shards).
`end_index` says where reading ended (the shard's sample count when it was read to its end),
which lets the worker compare it with sizes.json; a sample's `followed` says another sample
comes after it, so a shard holding more samples than sizes.json lists shows at the last listed one.
A sample with two members of one name (`KEY.jpg` twice; webdataset refuses such a shard) is marked
`duplicate` and skipped, counted, by decode.py: which image goes with the caption is unknown.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from bigclip.data.streams import read_errors, shard_location
from bigclip.errors import BigclipError
from bigclip.storage.access_checks import endpoint_unreachable, explain_error

COMPRESSED_SUFFIXES = (".tar.gz", ".tgz")
# webdataset's `base_plus_ext` rule (tests/test_data_pipeline.py checks it against webdataset's
# own function), kept here so reading local shards needs no webdataset import.
_KEY_AND_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def key_and_ext(path: str) -> tuple[str | None, str | None]:
    """'dir/0001.seg.png' -> ('dir/0001', 'seg.png'); a name without an extension -> (None, None)."""
    match = _KEY_AND_EXT.match(path)
    return (match.group(1), match.group(2)) if match else (None, None)


@dataclass(frozen=True)
class Cursor:
    """Where reading a shard continues: the index of the next sample and its tar byte offset (-1: unknown)."""

    index: int = 0
    byte: int = -1

    def to_json(self) -> list[int]:
        return [self.index, self.byte]

    @classmethod
    def from_json(cls, value: list[int]) -> Cursor:
        return cls(int(value[0]), int(value[1]))


START = Cursor(0, 0)


@dataclass
class RawSample:
    key: str
    index: int
    files: dict[str, bytes] = field(default_factory=dict)
    after: Cursor = START  # where reading continues once this sample is consumed
    duplicate: bool = False  # the shard holds one of its members twice (decode.py skips it)
    followed: bool = False  # another sample follows it in the shard (its header was read)


def _why(error: BaseException) -> str:
    """Why reading stopped: an endpoint that went away is said so (the shard is not damaged)."""
    return explain_error(error) if endpoint_unreachable(error) else f"{type(error).__name__}: {error}"


# Magic numbers of what a shard may be instead of the tar (or gzip'd tar) its name says.
FORMATS = {b"\xfd7zXZ\x00": "xz", b"BZh": "bzip2", b"\x28\xb5\x2f\xfd": "zstd", b"\x1f\x8b": "gzip",
           b"PK\x03\x04": "zip"}  # fmt: skip


class _Head:
    """A read stream that keeps its first bytes, to say what a shard that is no tar is."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream, self.head = stream, b""

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        if len(self.head) < 8:
            self.head += data[: 8 - len(self.head)]
        return data

    def __getattr__(self, name: str):  # noqa: ANN204 (whatever tarfile asks of the stream)
        return getattr(self.stream, name)


def _format_hint(head: bytes, url: str) -> str:
    """For a shard unreadable from its first byte: what it is, when its magic number says so."""
    kind = next((kind for magic, kind in FORMATS.items() if head.startswith(magic)), "")
    if not kind or (kind == "gzip" and is_compressed(url)):
        return ""
    return (f" (the file is {kind}-compressed; bigclip reads .tar shards, and gzip ones named .tar.gz or "
            ".tgz: recompress or rename it)")  # fmt: skip


PEEK_SAMPLES = (
    8  # what start-up checks read: enough that one damaged sample is not taken for the set's layout
)


def first_samples(url: str) -> list[RawSample]:
    """The first PEEK_SAMPLES samples of shard `url` (fewer for a short, empty or damaged one)."""
    return list(ShardSamples(url, stop=PEEK_SAMPLES))


def is_compressed(url: str) -> bool:
    return url.endswith(COMPRESSED_SUFFIXES)


def recording_tarinfo() -> type[tarfile.TarInfo]:
    """A TarInfo class that remembers why header parsing stopped.

    tarfile ends iteration *silently* on a truncated or garbled header anywhere but at the
    start, so a shard cut at a member boundary would look complete. Only the zero blocks that
    end an archive (EOFHeaderError) mean it really ended.
    """

    class RecordingTarInfo(tarfile.TarInfo):
        stopped_by: Exception | None = None

        @classmethod
        def frombuf(cls, buf, encoding, errors):  # noqa: ANN001 - tarfile's signature
            try:
                return super().frombuf(buf, encoding, errors)
            except tarfile.HeaderError as e:
                RecordingTarInfo.stopped_by = e
                raise

    return RecordingTarInfo


def check_clean_end(tar: tarfile.TarFile) -> None:
    """Raise unless the archive ended with its end-of-archive blocks.

    A file that ends without them (EmptyHeaderError: nothing where the next header should be)
    was cut short at a member boundary: its last sample may be missing members, so it counts
    as damaged like any other truncation (every tar writer, webdataset's and img2dataset's
    included, writes the end blocks).
    """
    stopped_by = tar.tarinfo.stopped_by
    if isinstance(stopped_by, tarfile.EmptyHeaderError):
        raise tarfile.ReadError(f"cut short at byte {tar.offset}: no end-of-archive blocks")
    if stopped_by is not None and not isinstance(stopped_by, tarfile.EOFHeaderError):
        raise tarfile.ReadError(f"damaged tar header at byte {tar.offset} ({stopped_by})")


def _open_tar(stream, *, mode: str, resumed: bool) -> tarfile.TarFile | None:
    try:
        return tarfile.open(fileobj=stream, mode=mode, tarinfo=recording_tarinfo())
    except tarfile.ReadError as e:
        if resumed and str(e) == "empty file":  # resumed exactly at the end of a tar without end blocks
            return None
        raise


def is_metadata(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.startswith(("__", "."))


class ShardSamples:
    """Iterate the samples of `url` from `start` up to `stop` (None: the end); afterwards `error` is ''
    or why reading stopped early, and `end_index` the index after the last sample seen."""

    def __init__(self, url: str, *, start: Cursor = START, stop: int | None = None) -> None:
        self.url = url
        self.start = start
        self.stop = stop
        self.error = ""
        self.end_index = start.index
        self.seekable = not is_compressed(url) and start.byte >= 0

    def __iter__(self) -> Iterator[RawSample]:
        base = self.start.byte if self.seekable else 0
        first_index = self.start.index if self.seekable else 0
        try:
            location, name = shard_location(self.url)
            errors = read_errors(location)
            stream = location.open_read(name, start=base)
        except (BigclipError, OSError) as e:
            self.error = f"cannot open shard {self.url}: {explain_error(e) if endpoint_unreachable(e) else e}"
            return
        with stream:
            head = _Head(stream) if base == 0 else stream
            yield from self._samples(head, base=base, first_index=first_index, errors=errors)
        if self.error and base == 0 and self.end_index == first_index:
            self.error += _format_hint(getattr(head, "head", b""), self.url)

    def _samples(
        self, stream: BinaryIO, *, base: int, first_index: int, errors: tuple[type[BaseException], ...]
    ) -> Iterator[RawSample]:
        mode = "r|gz" if is_compressed(self.url) else "r|"
        current: RawSample | None = None
        index, wanted = first_index, self.start.index  # samples before `wanted` are passed over unread
        try:
            tar = _open_tar(stream, mode=mode, resumed=base > 0)
            for info in tar or ():
                if not info.isreg() or is_metadata(info.name):
                    continue
                key, ext = key_and_ext(info.name)
                if key is None:
                    continue
                if current is not None and key != current.key:
                    # Complete: the next key's header has been read (before its data, which may be damaged).
                    current.after = self._cursor(index + 1, base + info.offset)
                    current.followed = True
                    if index >= wanted:
                        yield current
                    index, current = index + 1, None
                    self.end_index = index
                    if self.stop is not None and index >= self.stop:
                        return  # the piece ends here; the shard goes on for another reader
                if current is None:
                    current = RawSample(key=key, index=index)
                if index >= wanted:
                    current.duplicate |= ext.lower() in current.files
                    current.files[ext.lower()] = tar.extractfile(info).read()
                tar.members = []  # stream mode keeps every TarInfo otherwise
            if tar is not None:
                check_clean_end(tar)
            end = base + (tar.offset if tar else 0)
        except errors as e:
            self.error = _why(e)
            return  # the sample being read when the damage was found is dropped: it may be incomplete
        if current is not None:
            current.after = self._cursor(index + 1, end)
            self.end_index = index + 1
            if index >= wanted:
                yield current

    def _cursor(self, index: int, byte: int) -> Cursor:
        return Cursor(index, byte if not is_compressed(self.url) else -1)
