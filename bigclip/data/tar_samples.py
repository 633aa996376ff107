"""Webdataset samples from one tar shard, each with the cursor just after it.

A webdataset shard is a tar whose consecutive members sharing a key form a sample
(`0001.jpg`, `0001.txt` -> key '0001'; the key is the path up to the first dot of the
file name, webdataset's `base_plus_ext`). Reading is our own rather than webdataset's
iterators because exact resume needs, for every sample, where the *next* one starts: a
`Cursor` (sample index, tar byte offset). A resumed reader seeks (local) or issues a ranged
GET (S3) straight to that byte. Compressed shards (.tar.gz, .tgz) cannot be entered
mid-stream; they are re-read from the start and the first `index` samples skipped.

A truncated or unreadable shard is not an error: the reader stops, `error` says why, and
the samples read before the damage are kept.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field

from bigclip.data.streams import open_shard
from bigclip.errors import DataError
from bigclip.storage.s3 import S3Settings, is_s3

COMPRESSED_SUFFIXES = (".tar.gz", ".tgz")
# webdataset's `base_plus_ext` rule (tests/test_data_pipeline.py checks it against webdataset's
# own function), kept here so reading local shards needs no webdataset import.
_KEY_AND_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def key_and_ext(path: str) -> tuple[str | None, str | None]:
    """'dir/0001.seg.png' -> ('dir/0001', 'seg.png'); a name without an extension -> (None, None)."""
    match = _KEY_AND_EXT.match(path)
    return (match.group(1), match.group(2)) if match else (None, None)


def read_errors(url: str) -> tuple[type[BaseException], ...]:
    """What reading a shard raises when it is truncated or unreadable (botocore's only for S3)."""
    errors: tuple[type[BaseException], ...] = (tarfile.TarError, EOFError, OSError, DataError)
    if is_s3(url):
        from botocore.exceptions import BotoCoreError
        from urllib3.exceptions import HTTPError

        errors += (BotoCoreError, HTTPError)
    return errors


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


def is_compressed(url: str) -> bool:
    return url.endswith(COMPRESSED_SUFFIXES)


def recording_tarinfo() -> type[tarfile.TarInfo]:
    """A TarInfo class that remembers why header parsing stopped.

    tarfile ends iteration *silently* on a truncated or garbled header anywhere but at the
    start, so a shard cut at a member boundary would look complete. Only two zero blocks
    (EOFHeaderError) or a clean end of file (EmptyHeaderError) mean the archive really ended.
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
    stopped_by = tar.tarinfo.stopped_by
    if stopped_by is not None and not isinstance(
        stopped_by, (tarfile.EOFHeaderError, tarfile.EmptyHeaderError)
    ):
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
    """Iterate the samples of `url` from `start`; afterwards `error` is '' or why reading stopped early."""

    def __init__(self, url: str, *, start: Cursor = START, s3: S3Settings | None = None) -> None:
        self.url = url
        self.start = start
        self.s3 = s3
        self.error = ""
        self.seekable = not is_compressed(url) and start.byte >= 0

    def __iter__(self) -> Iterator[RawSample]:
        base = self.start.byte if self.seekable else 0
        first_index = self.start.index if self.seekable else 0
        try:
            stream = open_shard(self.url, start=base, s3=self.s3)
        except DataError as e:
            self.error = str(e)
            return
        with stream:
            for sample in self._samples(stream, base=base, first_index=first_index):
                if sample.index >= self.start.index:  # skips only when re-reading a compressed shard
                    yield sample

    def _samples(self, stream, *, base: int, first_index: int) -> Iterator[RawSample]:
        mode = "r|gz" if is_compressed(self.url) else "r|"
        current: RawSample | None = None
        index = first_index
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
                    yield current
                    index, current = index + 1, None
                if current is None:
                    current = RawSample(key=key, index=index)
                current.files[ext.lower()] = tar.extractfile(info).read()
                tar.members = []  # stream mode keeps every TarInfo otherwise
            if tar is not None:
                check_clean_end(tar)
            end = base + (tar.offset if tar else 0)
        except read_errors(self.url) as e:
            self.error = f"{type(e).__name__}: {e}"
            return  # the sample being read when the damage was found is dropped: it may be incomplete
        if current is not None:
            current.after = self._cursor(index + 1, end)
            yield current

    def _cursor(self, index: int, byte: int) -> Cursor:
        return Cursor(index, byte if not is_compressed(self.url) else -1)
