"""Which code opens which URI: the registry of storage schemes (scheme -> opener).

    register_scheme("gs", "mypackage.gcs:GcsLocation")     # or the callable itself
    open_location("gs://bucket/runs")                       # -> GcsLocation("gs://...", OpenOptions())

A URI without `://` is a local path, `file://` a local URL; every other scheme is looked up
here. Built in: `s3` (s3_location.py), `http` and `https` (http_location.py, read-only). An
opener is called as `opener(uri, options)` and returns a `Location` (locations.py); it may be
given as "module:attribute" so that registering imports nothing until a URI of the scheme is
opened (an S3 library is loaded only by a run that uses S3). Registering a scheme is the
statement that its store keeps the storage contract (docs/architecture.md): whole-object
writes, exclusive creation, listings that show what was written.

This is the only module that takes a URI apart by scheme; everything else asks it
(`is_local`) or opens a location.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bigclip.named_objects import import_named

SEPARATOR = "://"
LOCAL_URL = "file"


@dataclass(frozen=True)
class OpenOptions:
    """How the caller will use a location; a scheme ignores what does not apply to it."""

    max_attempts: int | None = None  # tries per request (None: the scheme's default)
    fast_fail: bool = False  # validation: few tries and short timeouts, so a wrong bucket fails in seconds
    fork_safe: bool = False  # used in data workers or in a thread of a process that forks


Opener = Callable[[str, OpenOptions], Any]  # returns a Location (locations.py, which imports this module)

BUILT_IN: dict[str, Opener | str] = {
    "s3": "bigclip.storage.s3_location:open_s3",
    "http": "bigclip.storage.http_location:HttpLocation",
    "https": "bigclip.storage.http_location:HttpLocation",
}
_openers: dict[str, Opener | str] = dict(BUILT_IN)
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


def register_scheme(scheme: str, opener: Opener | str) -> None:
    """From now on, open `scheme://...` URIs with `opener(uri, options)`, in this process and in the
    data workers it starts (they restore the registry, see settings.StorageState)."""
    if not _SCHEME.fullmatch(scheme) or scheme == LOCAL_URL:
        raise ValueError(f"{scheme!r} cannot be registered: give a lower-case URI scheme other than file")
    _openers[scheme] = opener


def unregister_scheme(scheme: str) -> None:
    """Forget a registered scheme (a built-in one returns to its built-in opener)."""
    _openers.pop(scheme, None)
    if scheme in BUILT_IN:
        _openers[scheme] = BUILT_IN[scheme]


def registered_openers() -> dict[str, Opener | str]:
    return dict(_openers)


def restore_openers(openers: dict[str, Opener | str]) -> None:
    _openers.clear()
    _openers.update(openers)


def scheme_of(uri: str) -> str:
    """'s3://b/k' -> 's3'; a local path -> ''."""
    head, separator, _ = uri.partition(SEPARATOR)
    return head.lower() if separator and _SCHEME.fullmatch(head.lower()) else ""


def is_local(uri: str) -> bool:
    """A local path or a file:// URL: no object store behind it."""
    return scheme_of(uri) in ("", LOCAL_URL)


def local_path(uri: str) -> str:
    """The path of a local path or file:// URL ('file:///x' -> '/x')."""
    if scheme_of(uri) != LOCAL_URL:
        return uri
    return uri[len(LOCAL_URL + SEPARATOR) :] or "/"


def opener_for(scheme: str) -> Opener | None:
    """The registered opener of `scheme`, imported now if it was registered by name."""
    opener = _openers.get(scheme)
    if isinstance(opener, str):
        opener = import_named(opener)
    return opener
