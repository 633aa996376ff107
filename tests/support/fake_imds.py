"""A small EC2 instance metadata service (IMDSv2) on 127.0.0.1, counting and optionally throttling.

botocore's instance-role credential provider (botocore/utils.py, `InstanceMetadataFetcher`) makes
three requests per credential look-up: `PUT /latest/api/token` (IMDSv2 session token), `GET
/latest/meta-data/iam/security-credentials/` (the role's name), `GET .../security-credentials/ROLE`
(the keys, as JSON with an `Expiration`). This server answers them as EC2 does, so a real boto3
client, pointed here by `AWS_EC2_METADATA_SERVICE_ENDPOINT` with no other credentials in its
environment, resolves real (dummy) keys through botocore's own code path, and every look-up shows
in `counts`:

    with FakeIMDS() as imds:                     # imds.env: the variables to point clients here
        imds.throttle(rate=5, burst=2)           # then 429 past 5 requests a second, as IMDS throttles
        imds.refuse(3)                           # or: the next 3 requests get 429, whatever their pace
        ...
        imds.lookups                             # credential documents served (one per look-up)

The keys served are the loopback S3's dummy ones (moto accepts any signature).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bigclip.demo.loopback_s3 import DUMMY_CREDENTIALS
from support.s3_fault_proxy import TokenBucket

ROLE = "bigclip-test-role"
TOKEN_PATH = "/latest/api/token"
CREDENTIALS_PATH = "/latest/meta-data/iam/security-credentials/"
# What a client's environment must not hold for the instance role to be asked (the chain's
# earlier providers: environment keys, shared files, profiles, containers).
CHAIN_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE",
)  # fmt: skip


class FakeIMDS:
    def __init__(self, *, lifetime_s: int = 6 * 3600) -> None:
        self.lifetime_s = lifetime_s
        self.counts: Counter[str] = Counter()  # "token" / "role" / "credentials" / "other" -> requests
        self.throttled = 0  # requests answered 429
        self._bucket: TokenBucket | None = None
        self._refusals = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def lookups(self) -> int:
        """Credential documents served: one per completed look-up (throttled tries not counted)."""
        with self._lock:
            return self.counts["credentials"]

    def env(self, config_file: str) -> dict[str, str]:
        """Variables for a client that must take its keys from here (`config_file`: an empty file,
        so no ~/.aws profile answers first)."""
        return {
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "false",
            "AWS_CONFIG_FILE": config_file,
            "AWS_SHARED_CREDENTIALS_FILE": config_file,
        }

    def throttle(self, *, rate: float | None, burst: float = 1.0) -> None:
        """Answer 429 past `rate` requests a second (None: never)."""
        with self._lock:
            self._bucket = TokenBucket(rate, burst) if rate is not None else None

    def refuse(self, n: int) -> None:
        """Answer the next `n` requests 429, whatever their pace (a deterministic throttle)."""
        with self._lock:
            self._refusals = n

    def admit(self, kind: str) -> bool:
        with self._lock:
            refused = self._refusals > 0
            self._refusals -= refused
            if refused or (self._bucket is not None and not self._bucket.take(time.monotonic())):
                self.throttled += 1
                return False
            self.counts[kind] += 1
            return True

    def credentials(self) -> bytes:
        now = datetime.datetime.now(datetime.timezone.utc)
        expires = now + datetime.timedelta(seconds=self.lifetime_s)
        document = {
            "Code": "Success",
            "LastUpdated": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "Type": "AWS-HMAC",
            "AccessKeyId": DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "SecretAccessKey": DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "Token": "bigclip-fake-imds-session-token",
            "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        return json.dumps(document).encode()

    def start(self) -> FakeIMDS:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeIMDS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kind(method: str, path: str) -> str:
    if method == "PUT" and path == TOKEN_PATH:
        return "token"
    if method == "GET" and path == CREDENTIALS_PATH:
        return "role"
    if method == "GET" and path == CREDENTIALS_PATH + ROLE:
        return "credentials"
    return "other"


def _handler_for(imds: FakeIMDS) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _handle(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            kind = _kind(self.command, self.path)
            if not imds.admit(kind):
                self._reply(429, b"Too Many Requests")
            elif kind == "token":
                self._reply(200, b"bigclip-fake-imds-token")
            elif kind == "other" or self.headers.get("x-aws-ec2-metadata-token") is None:
                self._reply(404 if kind == "other" else 401, b"")  # this service wants IMDSv2 tokens
            elif kind == "role":
                self._reply(200, ROLE.encode())
            else:
                self._reply(200, imds.credentials())

        do_GET = do_PUT = _handle

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler
