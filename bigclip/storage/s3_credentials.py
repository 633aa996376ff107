"""One boto3 session per process, whose credential look-ups back off when the metadata service throttles.

What botocore retries (botocore/credentials.py `create_credential_resolver`, utils.py): the chain
tries the environment, assume-role, the shared files and profiles (SSO, credential_process, web
identity: their STS calls go through botocore clients, with their retries), the container endpoint
(ECS/EKS: 3 tries, 1 s apart), then the EC2 instance metadata service (`InstanceMetadataFetcher`:
an IMDSv2 token, the role's name, the keys). That last one makes `metadata_service_num_attempts`
tries, 1 by default, with no pause between them; a throttled answer (429, 5xx) or a dropped
connection ends the look-up with no keys, and the process's first S3 request then fails with
NoCredentialsError (a data worker reports every shard it opens as damaged). IMDS throttles per
instance, and a node runs 8 ranks x 8-12 data workers; AWS's advice is to cache the keys and back off.

So a process resolves its keys once, through one session shared by its clients (a data worker keeps
its own for the whole run), and the metadata fetcher's requests are retried on a throttle answer or
a dropped connection, with exponential backoff and full jitter; refreshes of instance-role keys go
through the same fetcher. A metadata service that is not there (connection refused or never
answered: not on EC2) is not retried, so a box without credentials fails as fast as before.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("bigclip.storage")

IMDS_TRIES = 8  # per request: 0.25 s .. 16 s pauses, ~30 s at most in all before the look-up gives up
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 16.0
THROTTLE_STATUSES = frozenset({429, 500, 502, 503, 504})

_sessions: dict[int, Any] = {}


def process_session() -> Any:
    """This process's boto3 Session (made once per process: a fork makes its own)."""
    pid = os.getpid()
    if pid not in _sessions:
        import boto3
        import botocore.session

        core = botocore.session.get_session()
        back_off_instance_metadata(core)
        _sessions[pid] = boto3.session.Session(botocore_session=core)
    return _sessions[pid]


def back_off_instance_metadata(core: Any) -> bool:
    """Make the session's instance-metadata look-ups retry throttled requests with backoff.

    False (and nothing changed) if this botocore lays out its credential chain otherwise.
    """
    try:
        provider = core.get_component("credential_provider").get_provider("iam-role")
        http = provider._role_fetcher._session  # botocore's IMDS fetcher sends through this only
    except Exception as e:  # a botocore without these parts: its own behaviour stays
        log.debug("instance-metadata look-ups keep botocore's own retries: %r", e)
        return False
    http.send = BackoffSend(http.send)
    return True


class BackoffSend:
    """`send(request)` retried, with full-jitter exponential backoff, while the answer is a throttle."""

    tries = IMDS_TRIES

    def __init__(self, send: Callable[[Any], Any], *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.send, self.sleep = send, sleep

    def __call__(self, request: Any) -> Any:
        from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

        for attempt in range(self.tries):
            last = attempt == self.tries - 1
            try:
                response = self.send(request)
            except (ConnectionClosedError, ReadTimeoutError):  # reached, then dropped or slow: busy
                if last:
                    raise
            else:
                if response.status_code not in THROTTLE_STATUSES or last:
                    return response
            self.sleep(random.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)))
        raise AssertionError("unreachable")
