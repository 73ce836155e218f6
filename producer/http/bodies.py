"""Request bodies read with the ledger's exact JSON reader (every number a Decimal, as
``producer.submit`` wants), so an amount never passes through a binary float on the way in.

A body that is not JSON at all is a 400 (``malformed-body``), as FastAPI's own parse answers for
the routes it reads (workers/server/app.py); 422 is for JSON that breaks a rule, naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from outbox.errors import InvalidIntent
from outbox.ledger.envelope import loads_exact
from producer.http.problems import malformed_body


def exact_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise malformed_body(f"not UTF-8 (byte {exc.start} cannot be decoded); send JSON") from None
    if not text.strip():
        raise malformed_body("empty; send a JSON object")
    try:
        return loads_exact(text, field="body")
    except InvalidIntent as exc:
        if isinstance(exc.__cause__, json.JSONDecodeError):
            raise malformed_body(exc.reason) from exc
        raise
