"""Intake under overload: past ``OUTBOX_API_MAX_BACKLOG`` operations that a tenant's fleet still owes
work (not yet sent, or outcome unknown: outbox.service.operations.BACKLOG), a new intent is answered
429 with ``Retry-After`` instead of being stored. The backlog then grows no further than the limit
while the fleet settles at its own pace, and intake answers at once either way (accepted, or come
back later) instead of piling up work the fleet cannot reach before its callers give up.

A resubmit of an intent already stored is still answered (200 and the operation): a client that
lost its answer must always be able to find out what happened. Nothing is stored for a 429, so the
same idempotency key is safe to send again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from outbox.service import operations
from producer.http.problems import Problem

# A tenant's backlog is counted at most this often per server process; between two counts the
# gate answers from the last one (a burst may pass the limit by what arrives within a second).
BACKLOG_CHECK_S = 1.0
# What a 429 asks the client to wait: about the time the gate takes to see the backlog shrink.
RETRY_AFTER_S = 2


@dataclass
class BacklogGate:
    limit: int  # 0: off
    seen: dict[str, tuple[int, float]] = field(default_factory=dict)  # tenant -> (count, at)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, session: Session, tenant: str) -> int:
        """The tenant's backlog as last counted (within BACKLOG_CHECK_S), counted now if older."""
        now = time.monotonic()
        with self.lock:
            cached = self.seen.get(tenant)
        if cached is not None and now - cached[1] < BACKLOG_CHECK_S:
            return cached[0]
        counted = operations.backlog(session, tenant, up_to=self.limit)
        with self.lock:
            if len(self.seen) > 10_000:
                self.seen.clear()
            self.seen[tenant] = (counted, now)
        return counted

    def refusal(self, session: Session, tenant: str, idempotency_key: object) -> Problem | None:
        """The 429 for a new intent of ``tenant`` while its backlog is at the limit; None when it may be
        submitted (the gate is off, the backlog is below the limit, or the key is already stored: a
        replay is answered whatever the backlog). A missing or malformed key is left to submit's
        own validation (422 naming the field)."""
        if self.limit <= 0 or not isinstance(idempotency_key, str):
            return None
        backlog = self.count(session, tenant)
        if backlog < self.limit or operations.key_taken(session, tenant, idempotency_key):
            return None
        return Problem(
            429,
            "backlog-full",
            "Backlog full",
            f"this tenant has {backlog} operations waiting to be sent or reconciled, at or past the limit of"
            f" {self.limit} (OUTBOX_API_MAX_BACKLOG); nothing was stored: send the same intent again after"
            f" Retry-After (the same idempotency key is safe)",
            headers={"Retry-After": str(RETRY_AFTER_S)},
            members={"backlog": backlog, "limit": self.limit},
        )
