"""Leases that ran out: the sweep's move of dispatching operations into outcome_unknown.

A worker's lease bounds how long it may hold an operation, not whether its request can still
land: a crashed or frozen worker may have sent it. So an expired lease never goes back to
not_dispatched; only a lookup (or a fence, or a person) can tell what happened.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.errors import StaleFence
from outbox.ledger import failpoints
from outbox.ledger.clock import db_now
from outbox.ledger.models import Operation, core_table
from outbox.ledger.states import AttemptClass, EventKind, Status
from outbox.ledger.transitions import move
from outbox.ledger.writes import released

_OP = core_table(Operation)


def expire_leases(session: Session, *, limit: int = 500, actor: str = "sweep") -> list[str]:
    """dispatching operations whose lease ran out -> outcome_unknown (never back to not_dispatched).

    A crashed or frozen worker may have sent the request; only a lookup can tell.
    """
    rows = session.execute(
        select(_OP.c.id, _OP.c.fencing_token)
        .where(_OP.c.status == Status.DISPATCHING.value, _OP.c.lease_expires_at < db_now())
        .order_by(_OP.c.lease_expires_at)
        .limit(limit)
    ).all()
    failpoints.hit("sweep.after_select_before_update")
    moved = []
    for row in rows:
        try:
            move(
                session,
                row.id,
                sources=[Status.DISPATCHING],
                to=Status.OUTCOME_UNKNOWN,
                event=EventKind.LEASE_EXPIRED,
                actor=actor,
                reason="lease expired: the worker may have sent the request",
                token=row.fencing_token,
                extra_where=[_OP.c.lease_expires_at < db_now()],
                error_class=AttemptClass.AMBIGUOUS.value,
                last_error="lease expired before the worker reported a result",
                next_attempt_at=db_now(),
                **released(),
            )
        except StaleFence:
            continue  # the owner finished (or renewed, or another sweep moved it) since our read
        moved.append(row.id)
    return moved
