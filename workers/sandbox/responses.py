"""Wire formats shared by the handlers: JSON encoding, Stripe-shaped errors, Retry-After."""

from __future__ import annotations

import email.utils
import json
import math
import time
from datetime import UTC, datetime
from typing import Any


def encode(data: Any) -> bytes:
    # Compact and deterministic, so a stored response replays byte-for-byte.
    return json.dumps(data, separators=(",", ":"), sort_keys=False).encode()


def error_body(type_: str, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """Stripe's error shape; tests match on `error.code` (the issue-pinned codes live there)."""
    error: dict[str, Any] = {"type": type_, "code": code, "message": message}
    if param is not None:
        error["param"] = param
    return {"error": error}


def retry_after_value(seconds: float, http_date: bool) -> str:
    """Retry-After as delta-seconds or an HTTP-date (RFC 9110 10.2.3).

    Both forms are rounded up to whole seconds: a client that honours the header must never
    be invited back earlier than the configured delay.
    """
    if not http_date:
        return str(math.ceil(seconds))
    when = math.ceil(time.time() + seconds)
    return email.utils.format_datetime(datetime.fromtimestamp(when, UTC), usegmt=True)
