"""A publication's manifest (`published.json`), its NAME rules, and how its kind is detected."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import asdict, dataclass, field

from bigclip.config.checkpoint import REGISTRY_SCHEME
from bigclip.errors import ConfigError, StorageError
from bigclip.storage.records import Inventory

PUBLISHED = "published.json"
FORMAT = "bigclip-published"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass
class Published:
    name: str
    kind: str  # dcp | safetensors | torch | files
    entry: str  # the file a loader opens ('' for kind files)
    objects: Inventory
    source: str = ""
    model: str = ""
    step: int | None = None
    created: str = ""
    version: int = 2  # 1: objects under checkpoints/NAME/objects/ (older bigclip); 2: shared blobs/
    uri: str = field(default="", compare=False)  # where it was read from; not stored

    @property
    def total_bytes(self) -> int:
        return self.objects.total_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of its distinct blobs: identical files are stored once."""
        return sum(self.blobs().values())

    def blobs(self) -> dict[str, int]:
        """sha256 -> size of every distinct file."""
        return {r.sha256: r.size for r in self.objects.values()}

    @property
    def root(self) -> str:
        """The folder of the entry file, inside the publication."""
        return self.entry.rpartition("/")[0]

    def to_json(self) -> bytes:
        body = {"format": FORMAT, **asdict(self)}
        body.pop("uri")
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, uri: str) -> Published:
        try:
            body = json.loads(data)
            if body.pop("format", None) != FORMAT:
                raise ValueError("not a publication manifest")
            body.setdefault("version", 1)
            if body["version"] > 2:
                raise ValueError(f"version {body['version']} is newer than this bigclip's (2)")
            body["objects"] = Inventory.from_json(body["objects"])
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


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def parse_registry_ref(uri: str) -> str | None:
    """'registry:NAME' -> NAME; anything else -> None."""
    return check_name(uri[len(REGISTRY_SCHEME) :]) if uri.startswith(REGISTRY_SCHEME) else None
