"""Keep credentials out of manifests, config dumps and log lines.

bigclip never reads credentials itself (they come from the AWS chain), but a caller's
config or metadata could carry one: a field named like a secret, a URL with user:password,
or the literal value of a credential variable from the environment. `redact` returns a copy
with all three replaced by "<redacted>".
"""

from __future__ import annotations

import os
import re
from typing import Any

REDACTED = "<redacted>"
_SENSITIVE_WORDS = {"secret", "password", "passwd", "token", "credential", "credentials"}
_SENSITIVE_SUBSTRINGS = ("access_key", "secret", "session_token", "api_key", "private_key")
_CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def is_sensitive_key(key: str) -> bool:
    lowered = key.lower().replace("-", "_")
    return bool(_SENSITIVE_WORDS & set(lowered.split("_"))) or any(
        s in lowered for s in _SENSITIVE_SUBSTRINGS
    )


def _secret_values() -> list[str]:
    # Short values would redact innocent text; real keys are 16+ characters.
    values = (os.environ.get(name, "") for name in _CREDENTIAL_VARIABLES)
    return [v for v in values if len(v) >= 8]


def redact_text(text: str, *, secrets: list[str] | None = None) -> str:
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    for secret in _secret_values() if secrets is None else secrets:
        text = text.replace(secret, REDACTED)
    return text


def redact(value: Any, *, secrets: list[str] | None = None) -> Any:
    """A copy of a JSON-like value (dicts, lists, strings, numbers) without credentials."""
    secrets = _secret_values() if secrets is None else secrets
    if isinstance(value, dict):
        return {
            k: REDACTED if is_sensitive_key(str(k)) and v not in ("", None) else redact(v, secrets=secrets)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets=secrets) for v in value]
    if isinstance(value, str):
        return redact_text(value, secrets=secrets)
    return value
