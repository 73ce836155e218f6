"""Every non-admin request the sandbox received, so tests can check timing and who got through.

Examples: the next attempt came no earlier than Retry-After; only half-open probes reached the
provider while a breaker was open. ``time`` is real wall-clock epoch seconds, so it compares with
the test's own clock; ``clock_time`` is the sandbox clock's (``POST /admin/clock`` moves it), so a
test that moves the sandbox's time instead of sleeping reads the waits it skipped there.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

BODY_KEPT = 2000  # characters of a creation's body kept in its entry (the digest covers all of it)


@dataclass
class RequestEntry:
    seq: int
    time: float
    clock_time: float  # the sandbox clock (wall time + offset_s) on arrival
    method: str
    path: str
    query: str
    tenant: str
    idempotency_key: str | None  # the header, or ?idempotency_key= on lookups
    fencing_token: str | None
    fault: str | None = None
    fault_id: int | None = None
    status: int | str | None = None  # HTTP status, "reset" or "stalled"; None while in progress
    replayed: bool = False
    object_id: str | None = None
    answered: float | None = None  # wall-clock epoch seconds a creation's answer was ready (calls in flight)
    traceparent: str | None = None  # the W3C trace header the call carried (a target's propagate_trace)
    # A creation's body as it arrived (text, cut at BODY_KEPT characters) and the SHA-256 of its bytes:
    # two requests under one key are the same request only with the same method, path, query and body.
    body: str | None = None
    body_digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RequestLog:
    def __init__(self, maxlen: int) -> None:
        self.entries: deque[RequestEntry] = deque(maxlen=maxlen)
        self._seq = itertools.count(1)

    def resize(self, maxlen: int) -> None:
        if maxlen != self.entries.maxlen:
            self.entries = deque(self.entries, maxlen=maxlen)

    def open(
        self, clock_time: float, method: str, path: str, query: str, tenant: str, key: str | None, token: str | None
    ) -> RequestEntry:
        entry = RequestEntry(next(self._seq), time.time(), clock_time, method, path, query, tenant, key, token)
        self.entries.append(entry)
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self._seq = itertools.count(1)

    def filter(self, filters: dict[str, str]) -> list[RequestEntry]:
        """Filters: path, key, method, tenant, status, fault, since_seq (exclusive)."""
        since = int(filters.get("since_seq", 0))
        out = []
        for e in self.entries:
            if e.seq <= since:
                continue
            if "path" in filters and e.path != filters["path"]:
                continue
            if "key" in filters and e.idempotency_key != filters["key"]:
                continue
            if "method" in filters and e.method != filters["method"].upper():
                continue
            if "tenant" in filters and e.tenant != filters["tenant"]:
                continue
            if "status" in filters and str(e.status) != filters["status"]:
                continue
            if "fault" in filters and e.fault != filters["fault"]:
                continue
            out.append(e)
        return out
