"""Handoffs as every surface lists, shows, takes and resolves them, for one tenant (the ledger's moves
are outbox/evidence/handoffs.py; retry as a new intent outbox/evidence/retries.py).

Who takes a case is an identity, as separation of duties compares them (``Caller.identity``:
``key:<id>`` for an API key or a console session of it; ``cli:<account>`` for the command line,
which holds the ledger's own credentials and vouches for the account that ran it), never text a
request carries."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.errors import HandoffNotFound, InvalidIntent
from outbox.evidence import handoffs, retries
from outbox.ledger import tracing
from outbox.ledger.models import Handoff, Operation
from outbox.ledger.provider_keys import SubmitRules
from outbox.ledger.states import PERSON_RESOLUTIONS, HandoffStatus, Resolution, Status
from outbox.service.inputs import BY_MAX, NOTE_MAX, REFERENCE_MAX, written

IDENTITY_MAX = 255

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


def with_operation(session: Session, handoff: Handoff) -> HandoffRow:
    op = session.get(Operation, handoff.operation_id, populate_existing=True)
    assert op is not None
    return HandoffRow(session.get(Handoff, handoff.id, populate_existing=True) or handoff, op)


def _identity(identity: str) -> str:
    written("identity", identity, max_len=IDENTITY_MAX, required=True)
    return identity


def take(session: Session, tenant: str | None, handoff_id: int, *, identity: str, over: bool = False) -> HandoffRow:
    """``identity`` owns the case of ``tenant`` from now (``over``: even when another does)."""
    handoff = handoffs.take(session, get(session, tenant, handoff_id), identity=_identity(identity), over=over)
    return with_operation(session, handoff)


def release(session: Session, tenant: str | None, handoff_id: int, *, identity: str, over: bool = False) -> HandoffRow:
    """Give the case back (``over``: someone else's)."""
    handoff = handoffs.release(session, get(session, tenant, handoff_id), identity=_identity(identity), over=over)
    return with_operation(session, handoff)


def resolve(
    session: Session,
    tenant: str | None,
    handoff_id: int,
    *,
    resolution: Resolution | str,
    by: str,
    note: str,
    reference: str | None = None,
    rules: SubmitRules | None = None,
    identity: str | None = None,
) -> Status:
    """A person's decision on a handoff of ``tenant``; returns the operation's state after it.
    ``retry-as-new-intent`` also submits the new intent (under ``rules``, the actions file's, as
    any submit: approvals, provider keys, objects); the handoff's operation then names it
    (``retried_as``). ``identity``: who decides, as the surface knows them (recorded beside ``by``)."""
    written("--by", by, max_len=BY_MAX)
    written("--note", note, max_len=NOTE_MAX)
    written("--reference", reference, max_len=REFERENCE_MAX)
    value = resolution.value if isinstance(resolution, Resolution) else resolution
    if value not in {r.value for r in PERSON_RESOLUTIONS}:
        raise InvalidIntent("--as", f"one of {', '.join(r.value for r in PERSON_RESOLUTIONS)}")
    resolution = Resolution(resolution)
    handoff = get(session, tenant, handoff_id)
    parent = session.execute(select(Operation.traceparent).where(Operation.id == handoff.operation_id)).scalar()
    attributes = {"outbox.operation_id": handoff.operation_id, "outbox.handoff.resolution": resolution.value}
    with tracing.span("outbox.handoff.resolve", parent=parent, attributes=attributes) as span:
        if resolution is Resolution.RETRY_AS_NEW_INTENT:
            if reference:
                raise InvalidIntent("--reference", "only with --as succeeded")
            retried = retries.retry_as_new_intent(session, handoff, by=by, note=note, rules=rules, identity=identity)
            span.set(**{"outbox.status": Status.ABANDONED.value, "outbox.retried_as": retried.new.operation_id})
            return Status.ABANDONED
        status = handoffs.resolve(session, handoff, resolution=resolution, by=by, note=note, reference=reference)
        span.set(**{"outbox.status": status.value})
        return status
