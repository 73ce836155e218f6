"""The gate of a doorbell: which of its operations are due, and which wait for an open breaker.

A doorbell's first read (nothing locked) says which ids are due and what their deadlines are.
While a downstream's breaker is open an operation is not claimed at all: it is parked until the
breaker may close (outbox/ledger/waits.py), which costs no fencing token, attempt row or budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from breaker import Open
from outbox.ledger import failpoints
from outbox.ledger.claims import read_due
from outbox.ledger.clock import LedgerClock, as_utc
from outbox.ledger.hot_path import LedgerConnection
from outbox.ledger.waits import park_for_breaker
from workers.dispatch.outcomes import RetryAt, breaker_wait
from workers.provider.actions import ActionConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Due:
    """A not_dispatched, due operation as read before claiming (enough for the deadline)."""

    action: str
    created_at: datetime
    deadline_at: datetime | None
    max_attempts: int | None
    attempt_count: int
    clock: LedgerClock  # the database's time when read: deadlines are judged on it


def read_due_ops(ledger: LedgerConnection, operation_ids: Sequence[str]) -> dict[str, _Due]:
    with ledger.one_statement() as session:
        rows = read_due(session, operation_ids)
    dues = {}
    # Most budget left first: while a breaker is half-open, the first operation asked gets the
    # probe, so an outage's probes rotate even when a lagging relay rings several at once.
    for row in sorted(rows, key=lambda r: r.attempt_count):
        created, read_at = as_utc(row.created_at), as_utc(row.db_now)
        assert created is not None and read_at is not None
        dues[row.id] = _Due(
            row.action, created, as_utc(row.deadline_at), row.max_attempts, row.attempt_count, LedgerClock(read_at)
        )
    return dues


def park_while_open_if_due(
    sessions: sessionmaker[Session],
    operation_id: str,
    action: ActionConfig,
    decision: Open,
    *,
    actor: str,
    spent_attempts: int,
    now: datetime,
) -> RetryAt | None:
    """Breaker open: not sent, not claimed; the operation stays not_dispatched until the reopen time.

    No claim means no attempt row and no attempt number, so the wait costs no attempt budget (the
    deadline still applies: the caller checked it). Guarded like a claim: only a not_dispatched,
    due row moves, so a concurrent claim or park by another worker wins and we do nothing.
    """
    wait = breaker_wait(action, wait_s=decision.wait_s, now=now, spent_attempts=spent_attempts)
    failpoints.hit("gate.after_select_before_update")
    with sessions.begin() as session:
        if not park_for_breaker(session, operation_id, delay_s=wait.delay_s, reason=wait.why, actor=actor):
            return None
    log.info(
        "breaker open: parked for %.3fs",
        wait.delay_s,
        extra={"operation_id": operation_id, "target": action.target, "delay_s": wait.delay_s},
    )
    return wait
