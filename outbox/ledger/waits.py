"""Waits that send nothing and claim nothing: a not_dispatched operation parked, or woken.

While a downstream's breaker is open, a worker does not claim the operations it was rung for: no
fencing token, no attempt row, no attempt budget spent. It parks each one (not_dispatched ->
not_dispatched, ``waiting_for = breaker``) until the breaker may close. An operator's breaker reset
wakes every operation parked that way (and only those: a retry scheduled by backoff or Retry-After
keeps its time). Both are moves of the state table (states.ALLOWED), guarded like a claim, and
each row moved gets its event row.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import update
from sqlalchemy.orm import Session

from outbox.ledger.clock import db_now
from outbox.ledger.events import record_events
from outbox.ledger.models import Operation, core_table
from outbox.ledger.states import EventKind, Status, WaitingFor, check_allowed

_OP = core_table(Operation)
# The move both make; the state table must list it (and tests/conftest.py checks every move taken).
PARK = (Status.NOT_DISPATCHED, Status.NOT_DISPATCHED)
check_allowed("*", [PARK[0]], PARK[1])


def park_for_breaker(session: Session, operation_id: str, *, delay_s: float, reason: str, actor: str) -> bool:
    """Park a due not_dispatched operation for ``delay_s``; False if it was not due any more
    (another worker claimed or parked it first: it wins, we do nothing)."""
    row = session.execute(
        update(_OP)
        .where(
            _OP.c.id == operation_id,
            _OP.c.status == Status.NOT_DISPATCHED.value,
            _OP.c.next_attempt_at <= db_now(),
        )
        .values(
            next_attempt_at=db_now(delay_s),
            waiting_for=WaitingFor.BREAKER.value,
            reason=reason,
            updated_at=db_now(),
        )
        .returning(_OP.c.id, _OP.c.fencing_token)
    ).all()
    _moved(session, row, EventKind.BREAKER_OPEN, reason, actor)
    return bool(row)


def wake_breaker_waits(session: Session, action_names: Sequence[str], *, reason: str, actor: str) -> list[str]:
    """Operations of these actions parked by their breaker and not yet due -> due now."""
    if not action_names:
        return []
    rows = session.execute(
        update(_OP)
        .where(
            _OP.c.status == Status.NOT_DISPATCHED.value,
            _OP.c.action.in_(list(action_names)),
            _OP.c.waiting_for == WaitingFor.BREAKER.value,
            _OP.c.next_attempt_at > db_now(),
        )
        .values(next_attempt_at=db_now(), waiting_for=None, reason=reason, updated_at=db_now())
        .returning(_OP.c.id, _OP.c.fencing_token)
    ).all()
    _moved(session, rows, EventKind.BREAKER_RESET, reason, actor)
    return [r.id for r in rows]


def _moved(session: Session, rows: Sequence[tuple[str, int]], event: EventKind, reason: str, actor: str) -> None:
    record_events(session, rows, from_status=PARK[0], to=PARK[1], kind=event, reason=reason, actor=actor)
