"""The http:// and https:// schemes: a URL's folder as a download-only `Location`.

    parent, name = open_parent("https://host/models/open_clip_model.safetensors")
    with parent.open_read(name) as stream: ...

Web servers list nothing and take no writes, so this location only reads objects by name
(from a byte, with a `Range` header); `listable` is False, and callers that would list (weights,
registry sources) download the object instead. Everything else raises StorageError saying so.
URLs are redacted in messages (a user:password or a signed query must not reach a log).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any, BinaryIO, NoReturn

from bigclip.errors import StorageError
from bigclip.storage.redact import redact_text
from bigclip.storage.schemes import OpenOptions

TIMEOUT_S = 60


class HttpLocation:
    read_errors: tuple[type[BaseException], ...] = (OSError,)  # urllib's errors are OSErrors
    service = ""
    listable = False

    def __init__(self, uri: str, options: OpenOptions | None = None) -> None:
        self.uri = uri.rstrip("/")

    def child_uri(self, name: str) -> str:
        return f"{self.uri}/{name}" if name else self.uri

    def _request(self, relative: str, *, method: str = "GET", start: int = 0) -> Any:
        url = self.child_uri(relative)
        headers = {"Range": f"bytes={start}-"} if start else {}
        try:
            return urllib.request.urlopen(
                urllib.request.Request(url, headers=headers, method=method), timeout=TIMEOUT_S
            )
        except (urllib.error.URLError, OSError) as e:
            raise StorageError(f"cannot download {redact_text(url)}: {e}") from e

    def open_read(self, relative: str, *, start: int = 0) -> BinaryIO:
        """The response, streamed (its `length`: the bytes left, when the server says)."""
        return self._request(relative, start=start)

    def read_bytes(self, relative: str) -> bytes:
        with self._request(relative) as response:
            return response.read()

    def exists(self, relative: str) -> bool:
        try:
            self._request(relative, method="HEAD").close()
        except StorageError as e:
            if isinstance(e.__cause__, urllib.error.HTTPError) and e.__cause__.code == 404:
                return False
            raise
        return True

    def size(self, relative: str) -> int:
        with self._request(relative, method="HEAD") as response:
            length = response.headers.get("Content-Length")
        if length is None:
            self._refuse("tell the size of")
        return int(length)

    def _refuse(self, what: str) -> NoReturn:
        raise StorageError(f"{redact_text(self.uri)}: a web server's objects can only be downloaded; "
                           f"bigclip cannot {what} them there")  # fmt: skip

    def list_folders(self) -> list[str]:
        self._refuse("list")

    def list_files(self, folder: str) -> dict[str, int]:
        self._refuse("list")

    def readinto(self, relative: str, offset: int, buffer: memoryview) -> int:
        self._refuse("read ranges of")

    def write_bytes(self, relative: str, data: bytes) -> None:
        self._refuse("write")

    def open_sink(self, relative: str, *, overwrite: bool) -> Any:
        self._refuse("write")

    def create_exclusive(self, relative: str, data: bytes) -> bool:
        self._refuse("write")

    def put_file(self, relative: str, path: Any) -> None:
        self._refuse("upload")

    def copy(self, source: str, relative: str) -> None:
        self._refuse("copy")

    def delete(self, relative: str) -> None:
        self._refuse("delete")

    def delete_folder(self, folder: str) -> None:
        self._refuse("delete")

    def dcp_writer(self, folder: str, *, threads: int | None = None, world_size: int | None = None) -> Any:
        self._refuse("write checkpoints to")

    def dcp_reader(self, folder: str) -> Any:
        self._refuse("read checkpoints from")
