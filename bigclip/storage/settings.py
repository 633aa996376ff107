"""Process-wide storage settings: set once at start-up, read wherever a location is opened.

    configure_storage(s3_endpoint=cfg.checkpoint.s3_endpoint, s3_region=cfg.checkpoint.s3_region)
    open_location("s3://bucket/runs")        # uses them; no caller passes settings along

`bigclip train` and the offline commands configure storage once from --s3-endpoint and
--s3-region; empty values mean "from the environment" (AWS_ENDPOINT_URL, AWS_REGION, the AWS
config: see s3.py). A location reads the settings when it is opened and keeps them.

Data workers are forked on Linux and spawned elsewhere: a reader captures `StorageState`
(these settings and the registered schemes) when it is built and restores it in the worker,
so a spawned worker opens the same stores, through the same openers, as its parent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bigclip.storage.schemes import Opener, registered_openers, restore_openers


@dataclass(frozen=True)
class StorageSettings:
    s3_endpoint: str = ""  # "": AWS_ENDPOINT_URL(_S3), else AWS itself
    s3_region: str = ""  # "": AWS_REGION / AWS_DEFAULT_REGION / the AWS config


_settings = StorageSettings()


def configure_storage(*, s3_endpoint: str = "", s3_region: str = "") -> None:
    """Set this process's storage settings (every field: one left out returns to its default)."""
    global _settings
    _settings = StorageSettings(s3_endpoint=s3_endpoint or "", s3_region=s3_region or "")


def storage_settings() -> StorageSettings:
    return _settings


@contextmanager
def storage_configured(*, s3_endpoint: str = "", s3_region: str = "") -> Iterator[None]:
    """These settings inside the block, the previous ones after it (tests, one-off tools)."""
    global _settings
    previous = _settings
    configure_storage(s3_endpoint=s3_endpoint, s3_region=s3_region)
    try:
        yield
    finally:
        _settings = previous


@dataclass(frozen=True)
class StorageState:
    """What a data worker needs to open the stores its parent opens (it pickles: openers are
    module-level callables or "module:attribute" names)."""

    settings: StorageSettings
    openers: dict[str, Opener | str]

    @classmethod
    def capture(cls) -> StorageState:
        return cls(_settings, registered_openers())

    def restore(self) -> None:
        global _settings
        _settings = self.settings
        restore_openers(self.openers)
