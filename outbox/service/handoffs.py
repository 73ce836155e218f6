"""Handoffs as every surface lists, shows and resolves them, for one tenant (the ledger's moves are
outbox/evidence/handoffs.py)."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.errors import HandoffNotFound
from outbox.evidence import handoffs
from outbox.ledger import tracing
from outbox.ledger.models import Handoff, Operation
from outbox.ledger.states import HandoffStatus, Resolution, Status
from outbox.service.inputs import BY_MAX, NOTE_MAX, REFERENCE_MAX, written

LIMIT = 500
_MAX_ID = 2**63 - 1  # a BIGINT: a larger id names no handoff (and must not reach the database)


class HandoffRow(NamedTuple):
    handoff: Handoff
    operation: Operation


def listing(
    session: Session, tenant: str | None, *, include_resolved: bool = False, limit: int = LIMIT
) -> list[HandoffRow]:
    """Open handoffs (``include_resolved``: all), oldest first, each with its operation."""
    stmt = select(Handoff, Operation).join(Operation, Operation.id == Handoff.operation_id)
    if tenant is not None:
        stmt = stmt.where(Operation.tenant == tenant)
    if not include_resolved:
        stmt = stmt.where(Handoff.status == HandoffStatus.OPEN.value)
    rows = session.execute(stmt.order_by(Handoff.opened_at, Handoff.id).limit(limit)).all()
    return [HandoffRow(h, op) for h, op in rows]


def get(session: Session, tenant: str | None, handoff_id: int) -> Handoff:
    """The handoff with this id, if its operation is ``tenant``'s (None: any tenant)."""
    found = None
    if 1 <= handoff_id <= _MAX_ID:
        stmt = select(Handoff).join(Operation, Operation.id == Handoff.operation_id).where(Handoff.id == handoff_id)
        if tenant is not None:
            stmt = stmt.where(Operation.tenant == tenant)
        found = session.execute(stmt).scalar_one_or_none()
    if found is None:
        raise HandoffNotFound(f"no handoff {handoff_id}")
    return found


def resolve(
    session: Session,
    tenant: str | None,
    handoff_id: int,
    *,
    resolution: Resolution | str,
    by: str,
    note: str,
    reference: str | None = None,
) -> Status:
    """A person's decision on a handoff of ``tenant``; returns the operation's state after it."""
    written("--by", by, max_len=BY_MAX)
    written("--note", note, max_len=NOTE_MAX)
    written("--reference", reference, max_len=REFERENCE_MAX)
    handoff = get(session, tenant, handoff_id)
    parent = session.execute(select(Operation.traceparent).where(Operation.id == handoff.operation_id)).scalar()
    attributes = {"outbox.operation_id": handoff.operation_id, "outbox.handoff.resolution": str(resolution)}
    with tracing.span("outbox.handoff.resolve", parent=parent, attributes=attributes) as span:
        status = handoffs.resolve(session, handoff, resolution=resolution, by=by, note=note, reference=reference)
        span.set(**{"outbox.status": status.value})
        return status
