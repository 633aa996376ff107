"""S3 addressing and clients, shared by every S3 location (data, checkpoints, remote sync, registry).

One place decides the endpoint, region and addressing style (`S3Settings.resolve`: the process's
storage settings, settings.py, then the environment), so a loopback S3 server (tests, `make
demo`) and S3-compatible stores work everywhere once `--s3-endpoint` or `AWS_ENDPOINT_URL` is
set. Credentials always come from the standard AWS chain (environment, shared config, instance
role); bigclip never stores them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any

from bigclip.errors import StorageError
from bigclip.storage.s3_credentials import process_session
from bigclip.storage.settings import storage_settings

S3_SCHEME = "s3://"


def split_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b')."""
    if not uri.startswith(S3_SCHEME):
        raise StorageError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
    if len(bucket) < 3:
        raise StorageError(f"{uri!r}: S3 bucket names have at least 3 characters")
    return bucket, key


def join_s3_uri(bucket: str, key: str) -> str:
    return f"{S3_SCHEME}{bucket}/{key.lstrip('/')}"


@dataclass(frozen=True)
class S3Settings:
    """Endpoint and region. `endpoint=None` means AWS itself (virtual-hosted addressing).

    `region` "" means "not given": `region_name` then asks the AWS config (through botocore)
    the first time an S3 client needs it, so a run that never touches S3 imports no S3 library."""

    region: str
    endpoint: str | None = None

    @property
    def region_name(self) -> str:
        return self.region or _default_region()

    @classmethod
    def resolve(cls) -> S3Settings:
        """--s3-endpoint / --s3-region (configure_storage) win, then AWS_ENDPOINT_URL(_S3) /
        AWS_REGION / AWS_DEFAULT_REGION."""
        configured = storage_settings()
        endpoint = (
            configured.s3_endpoint
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        region = (
            configured.s3_region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or ""
        )
        return cls(region=region, endpoint=endpoint)

    @property
    def service(self) -> str:
        """Where requests go, for messages."""
        return f"S3 endpoint {self.endpoint or 'AWS'}, region {self.region_name}"

    @property
    def path_style(self) -> bool:
        # S3-compatible stores (MinIO, moto, Ceph) generally need path-style addressing.
        return self.endpoint is not None


S3_PACKAGES = {"boto3": "boto3", "s3torchconnector": "'s3torchconnector[dcp]'"}


def require_s3_package(module: str, *, uri: str = "") -> None:
    """Fail in seconds, naming the package, when an s3:// option needs a library that is missing
    (GPU images and air-gapped nodes often lack them; a local run never needs them)."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        what = f"{uri}: S3 access" if uri else "S3 access"
        raise StorageError(f"{what} needs {module}, which cannot be imported ({e}); "
                           f"install it with: pip install {S3_PACKAGES[module]}") from e  # fmt: skip


DEFAULT_ATTEMPTS = 10  # tries per request: the CRT client's default, and bigclip's boto3 one


def configured_attempts() -> int:
    """Tries per S3 request: AWS_MAX_ATTEMPTS (the AWS SDKs' own variable) when set, else 10. Read
    when a client is made; a value that is not a positive whole number is refused (StorageError)."""
    raw = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if not raw:
        return DEFAULT_ATTEMPTS
    if not raw.isdigit() or int(raw) < 1:
        raise StorageError(
            f"AWS_MAX_ATTEMPTS={raw!r} is not a number of tries per S3 request: set it to a whole number "
            f"of at least 1 (bigclip's default is {DEFAULT_ATTEMPTS}), or unset it"
        )
    return int(raw)


_boto3_clients: dict[tuple[int, S3Settings, bool, int | None], Any] = {}


def boto3_client(settings: S3Settings, *, fast_fail: bool = False, max_attempts: int | None = None) -> Any:
    """This process's boto3 S3 client for `settings` (clients are thread-safe but not fork-safe,
    so the cache is keyed by pid: data workers make their own).

    `fast_fail`: two attempts and short timeouts, for validation, where a wrong endpoint should
    fail in seconds rather than after ten adaptive retries. `max_attempts`: another retry
    budget (background copies that retry on their own schedule want few); by default
    `configured_attempts()`."""
    key = (os.getpid(), settings, fast_fail, max_attempts)
    if key not in _boto3_clients:
        require_s3_package("boto3")
        from botocore.config import Config

        retries = (
            {"max_attempts": 2, "mode": "standard"}
            if fast_fail
            else {"max_attempts": configured_attempts(), "mode": "adaptive"}
        )
        if max_attempts is not None:
            retries = {"max_attempts": max_attempts, "mode": "standard"}
        timeouts = {"connect_timeout": 5, "read_timeout": 30} if fast_fail else {}
        config = Config(
            s3={"addressing_style": "path" if settings.path_style else "auto"}, retries=retries, **timeouts
        )
        # One session per process: its keys are looked up once, with backoff (s3_credentials.py).
        _boto3_clients[key] = process_session().client(
            "s3", region_name=settings.region_name, endpoint_url=settings.endpoint, config=config
        )
    return _boto3_clients[key]


def s3torch_client(
    settings: S3Settings, *, max_attempts: int | None = None, part_size: int | None = None
) -> Any:
    """An s3torchconnector (CRT) client: what checkpoints stream through. `max_attempts`
    overrides its retry budget (default `configured_attempts()`; the CRT backs off exponentially
    from 500 ms with full jitter, each wait capped at 20 s); `part_size`: bytes per multipart
    part (default 8 MiB; every upload through this client is multipart, 2 + parts requests).

    s3torchconnector exports no client class with an endpoint and list/delete; its own DCP
    classes use `_s3client.S3Client`, and so does bigclip, from this one place only."""
    require_s3_package("s3torchconnector")
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    config = S3ClientConfig(
        force_path_style=settings.path_style, max_attempts=max_attempts or configured_attempts()
    )
    if part_size is not None:
        config = dataclasses.replace(config, part_size=part_size)
    return S3Client(settings.region_name, endpoint=settings.endpoint, s3client_config=config)


@functools.cache
def _default_region() -> str:
    """The AWS config's region (~/.aws/config, AWS_PROFILE), else us-east-1."""
    try:
        import botocore.session

        return botocore.session.get_session().get_config_variable("region") or "us-east-1"
    except Exception:  # no botocore, or no config at all
        return "us-east-1"
