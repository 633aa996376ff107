"""Can this process use a checkpoint location? Answered in seconds, before a model is built.

For S3: credentials resolve (botocore's chain, the one the CRT client also follows), the
bucket answers a LIST, and a probe object can be PUT, read back intact and DELETEd, through
the same s3torchconnector client checkpoints use (so path-style addressing and the endpoint
are tested too), with few retries so a wrong bucket fails fast. For a folder: it can be
created, written, read and deleted. `bigclip doctor` adds throughput on top.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from bigclip.errors import StorageError
from bigclip.storage.full_disk import disk_full
from bigclip.storage.locations import LocalLocation, Location
from bigclip.storage.s3_location import S3Location  # (imports no S3 library until used)

# Probe objects sit beside the checkpoints, each under its own name: no shared folder that one
# node could delete while another is writing into it (all nodes probe a shared filesystem at once).
PROBE_PREFIX = ".bigclip-preflight-"


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str


def probe_name() -> str:
    return f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def run_check(name: str, fn: Callable[[], str], *, timeout_s: float = 20.0) -> CheckResult:
    """Run one check with a deadline; a hung endpoint becomes a FAIL, not a hang."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        detail, ok = pool.submit(fn).result(timeout=timeout_s), True
    except FutureTimeout:
        detail, ok = f"no answer within {timeout_s:.0f}s (endpoint unreachable or blackholed?)", False
    except Exception as e:
        detail, ok = explain_error(e), False
    finally:
        pool.shutdown(wait=False)
    return CheckResult(name, ok, detail)


# Said of an endpoint that refuses connections or does not answer: at the start a wrong address,
# mid-run an endpoint that went away (what was read or written is not damaged).
_UNREACHABLE = (
    "cannot connect to the endpoint (refused or no answer: it is down, or not at that address): check it "
    "is up and that AWS_ENDPOINT_URL / --s3-endpoint name it"
)
_NO_BUCKET = "the bucket does not exist: check the bucket name (and --s3-region)"
_BAD_KEY = (
    "the access key is not valid for this endpoint: check AWS_ACCESS_KEY_ID/AWS_PROFILE and --s3-endpoint"
)
_THROTTLED = "S3 kept throttling (503 SlowDown) beyond the client's retries: retry later or save less often"
_HINTS = [
    (
        "no signing credentials",
        "no AWS credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE",
    ),
    ("bucket does not exist", _NO_BUCKET),
    ("nosuchbucket", _NO_BUCKET),
    ("access key id you provided does not exist", _BAD_KEY),
    (
        "could not be found",  # botocore's ProfileNotFound
        "the AWS profile is not in the AWS config files: fix or unset AWS_PROFILE",
    ),
    ("accessdenied", "access denied: the credentials lack permission for this bucket/prefix"),
    ("forbidden", "access denied (HTTP 403): check the credentials' permissions"),
    ("invalidaccesskeyid", _BAD_KEY),
    ("signaturedoesnotmatch", "the secret key does not match the access key"),
    ("throttled", _THROTTLED),
    ("slowdown", _THROTTLED),
    *(
        (needle, _UNREACHABLE)
        for needle in (
            "connection refused",
            "could not connect to the endpoint url",
            "connect timeout on endpoint",
            "network is unreachable",
            "no answer within",  # run_check's deadline passed
        )
    ),
    ("socket", "the connection to S3 kept failing (dropped or reset) beyond the client's retries"),
    ("dns", "cannot resolve the endpoint's host name: check AWS_ENDPOINT_URL / --s3-endpoint"),
    ("no space left on device", "the disk is full (ENOSPC): free space there, or write elsewhere"),
    ("disk quota exceeded", "the disk quota is full (EDQUOT): free space there, or write elsewhere"),
    ("file exists", "a file, not a folder, is at that path: give a folder"),
    ("not a directory", "a file, not a folder, is on that path: give a folder"),
    ("permission denied", "no permission to write there: give a folder this user can write to"),
    ("read-only file system", "the file system is read-only: give a writable folder"),
]


def explain_error(error: BaseException | str) -> str:
    """A one-line, actionable reading of an S3 or OS error, with the raw text's first line."""
    if not isinstance(error, str) and not isinstance(error, StorageError) and disk_full(error):
        error = f"OSError: {disk_full(error)}"  # the full disk a wrapping error (torch's zip writer's) hides
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    first = (text.splitlines() or [""])[0][:300]
    for needle, hint in _HINTS:
        if needle in text.lower():
            return f"{hint} [{str(error) if isinstance(error, StorageError) else first}]"
    return str(error) if isinstance(error, StorageError) else first


def endpoint_unreachable(error: BaseException | str) -> bool:
    """Whether `error` says the endpoint refused the connection or did not answer."""
    return explain_error(error).startswith(_UNREACHABLE)


def explained(error: BaseException) -> str:
    """`error`'s line, led by what it means when it says the endpoint went away (a checkpoint read
    or written mid-run then fails with the client's words only)."""
    text = str(error)
    return explain_error(error) if endpoint_unreachable(error) and _UNREACHABLE not in text else text


def access_checks(location: Location) -> list[tuple[str, Callable[[], str]]]:
    """(name, check) pairs in the order they are run; each check returns a detail line."""
    if isinstance(location, LocalLocation):
        return [("folder", lambda: _make_folder(location)), *_object_checks(location)]
    if isinstance(location, S3Location):
        return _s3_checks(location)
    return [("list", lambda: _list(location)), *_object_checks(location)]  # fsspec, a registered scheme


def check_access(location: Location, *, timeout_s: float = 20.0, what: str = "checkpoint location") -> None:
    """Raise StorageError at the first failing check, naming what to fix."""
    for name, fn in access_checks(location):
        result = run_check(name, fn, timeout_s=timeout_s)
        if not result.ok:
            raise StorageError(f"{what} {location.uri} is not usable: {name}: {result.detail}")


def write_probe(location: Location) -> tuple[str, str]:
    """A probe object holding a random token, for other nodes to look for: (name, token)."""
    name, token = probe_name(), uuid.uuid4().hex
    location.write_bytes(name, token.encode())
    return name, token


def probe_seen(location: Location, name: str, token: str, *, attempts: int = 5, pause_s: float = 1.0) -> bool:
    """Whether `location` holds the probe another process wrote. A few tries: a shared file system
    may show another node's new file a moment late (attribute caches); a node-local folder never."""
    for attempt in range(attempts):
        try:
            if location.read_bytes(name) == token.encode():
                return True
        except (StorageError, *location.read_errors):
            pass
        if attempt < attempts - 1:
            time.sleep(pause_s)
    return False


def _credentials() -> str:
    import botocore.session

    creds = botocore.session.get_session().get_credentials()
    if creds is None:
        raise StorageError(
            "no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
            "or run where an instance/IRSA role provides them"
        )
    return f"found (source: {creds.method})"  # never the key itself


def _s3_checks(location: S3Location) -> list[tuple[str, Callable[[], str]]]:
    settings = location.settings
    # Two attempts only: a wrong bucket or endpoint should fail now, not after ten back-offs.
    probe = S3Location(location.uri, settings=settings, fast_fail=True, fork_safe=location.fork_safe)

    def listing() -> str:
        probe.client.list_objects_v2(Bucket=probe.bucket, Prefix=probe._key(""), Delimiter="/", MaxKeys=1)
        return f"bucket {probe.bucket} answers (endpoint {settings.endpoint or 'AWS'}, region {settings.region_name})"

    def checkpoint_client() -> str:
        # Checkpoint shards go through s3torchconnector, whose credentials and endpoint are its own.
        next(iter(probe.crt_client.list_objects(probe.bucket, probe._key(""), "/", 1)), None)
        return "s3torchconnector answers"

    checks = [("credentials", _credentials), ("list", listing), *_object_checks(probe)]
    return checks if location.fork_safe else [*checks, ("checkpoint client", checkpoint_client)]


def _make_folder(location: LocalLocation) -> str:
    location.root.mkdir(parents=True, exist_ok=True)
    return f"{location.root} exists"


def _list(location: Location) -> str:
    location.list_folders()
    return f"{location.uri} answers a listing"


def _object_checks(location: Location) -> list[tuple[str, Callable[[], str]]]:
    """Put, read back and delete a probe object through the Location interface itself."""
    key = probe_name()
    payload = uuid.uuid4().bytes * 64

    def put() -> str:
        location.write_bytes(key, payload)
        return f"wrote {location.child_uri(key)}"

    def get() -> str:
        if location.read_bytes(key) != payload:
            raise StorageError("read back different bytes than were written")
        return "read back intact"

    def delete() -> str:
        location.delete(key)
        if location.exists(key):
            raise StorageError("the probe object is still there after deleting it")
        return "deleted"

    return [("put", put), ("get", get), ("delete", delete)]
