"""Webhook events as evidence: the provider tells us what happened, and the ledger takes it exactly as
it takes a lookup's answer.

The workers verify the signature and read the event (workers/webhooks/); here the ledger, in the
caller's transaction:

1. keeps the event once: its row is unique per (target, whose secret verified it, event id), so the
   provider's retry of an event it delivered before (webhooks are at-least-once) finds it and changes
   nothing, and so does a captured event posted again under another path its secret verifies;
2. finds the operation it names: by the key the provider saw (``provider_key``) or by the provider's
   reference recorded on it (``result_reference``), among the operations of the actions that map
   its type, of the endpoint's tenant only when the endpoint is a tenant's. None: a document without
   record (the reconciliation report lists it); several: ambiguous, none is moved;
3. applies what it says, under the row's lock, status and token guarded as every move:
   - succeeded: the provider's confirmation is written as an attempt row of its own (a lookup row,
     ``stale``: its writer never owned the operation), and applied as any late success is
     (outbox/evidence/late_successes.py): evidence wins. From a state that claims no outcome yet
     (dispatching, outcome_unknown, accepted, reconciliation_required, ...) -> succeeded, the token
     bumped, an open handoff closed; from a "no effect" end -> a person reviews; already succeeded:
     nothing, and a second reference is on record for the report;
   - failed: settles nothing by itself. Events come in any order (a payment's "failed" may precede its
     "succeeded"; PROVIDERS.md, rule 4), so the provider's current object decides: an accepted or
     outcome_unknown operation is made due now (``next_attempt_at``) and the reconciler's lookup reads
     it (failed_at_provider if it is failed there); one a worker is sending gets that lookup as soon as
     its finalize leaves it accepted / outcome_unknown (outbox/evidence/stored_events.py); a handoff
     that is re-checked gets its re-check now (outbox/evidence/rechecks.py); anything else is left to
     its owner (a person);
   - pending: recorded, nothing moves.

An event that came before its operation could take it (a success named by a reference the 202's
finalize had not recorded yet) is kept ``no_operation`` and applied later: outbox/evidence/stored_events.py.

``owns`` compares the event's object with the intent's arguments before an operation is taken as
the event's (the action's ``webhooks.match``: workers/webhooks/events.py); without it, a key or a
recorded reference is enough. An event that names only operations it refuses names none.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from outbox.actions.webhooks import WebhookOutcome
from outbox.evidence.late_successes import LateSuccess, PacketBuilder
from outbox.evidence.late_successes import apply as apply_late
from outbox.evidence.rechecks import recheck_now
from outbox.evidence.sinks import EvidenceSink
from outbox.ledger.clock import db_now
from outbox.ledger.models import Attempt, Operation, core_table
from outbox.ledger.states import AttemptClass, AttemptKind, EventKind, Status
from outbox.ledger.webhook_models import Disposition, WebhookEvent

_OP = core_table(Operation)
_AT = core_table(Attempt)
_EV = core_table(WebhookEvent)

# Where a failure event makes the lookup due now: what the reconciler looks up (claim_unknown).
FAILABLE = (Status.ACCEPTED, Status.OUTCOME_UNKNOWN)


@dataclass(frozen=True)
class EventReading:
    """What one action's ``webhooks`` mapping reads in an event."""

    action: str
    outcome: WebhookOutcome
    provider_key: str | None
    reference: str | None
    result: dict[str, Any] | None = None  # the object as the event carried it (masked before it is kept)


@dataclass(frozen=True)
class ReceivedEvent:
    """A verified event, as the workers read it."""

    target: str
    scope: str | None  # the tenant of /v1/webhooks/<target>/<tenant>; None: the target's own endpoint
    event_id: str
    event_type: str
    scheme: str
    signed_at: dt.datetime | None
    body_digest: str
    readings: Sequence[EventReading]  # one per action of the target that maps its type (none: ignored)
    # Tenants whose events come to their own endpoint only: the target's endpoint never settles theirs.
    exclude_tenants: Sequence[str] = ()
    # Whose secret verified it: "" the target's, else the tenant's whose own secret did (the dedupe key).
    verified_by: str = ""


@dataclass(frozen=True)
class Received:
    """What the ledger did with an event (its row says the same)."""

    disposition: Disposition
    duplicate: bool
    operation_id: str | None
    status: str | None  # its operation's status now
    moved_to: str | None
    note: str


# (operation, reading) -> why the event's object is not this operation's (None: it is); see the docstring.
Owns = Callable[[Operation, EventReading], str | None]
# (operation, reading) -> what is kept of the event's object on the operation (masked by the caller).
ResultOf = Callable[[Operation, EventReading], dict[str, Any] | None]


def receive(
    session: Session,
    event: ReceivedEvent,
    *,
    actor: str,
    sink: EvidenceSink,
    packet: PacketBuilder,
    owns: Owns | None = None,
    result_of: ResultOf | None = None,
) -> Received:
    """Keep ``event`` once and apply it to its operation (module docstring), in the caller's transaction."""
    row_id = _keep(session, event)
    if row_id is None:
        return _duplicate(session, event)
    if not event.readings:
        return _finish(session, row_id, Disposition.IGNORED, None, None, None, "no action of the target maps this type")
    found, refused = [], []
    for op, reading in _operations(session, event):
        why = owns(op, reading) if owns is not None else None
        if why is None:
            found.append((op, reading))
        else:
            refused.append(why)
    if not found:
        named = ", ".join(f"{r.action}: key {r.provider_key!r}, reference {r.reference!r}" for r in event.readings)
        note = f"no operation ({named})" + (f"; named but not ours: {'; '.join(refused)}" if refused else "")
        return _finish(session, row_id, Disposition.NO_OPERATION, None, None, event.readings[0], note)
    if len({op.id for op, _ in found}) > 1:
        ids = ", ".join(sorted({op.id for op, _ in found}))
        return _finish(session, row_id, Disposition.AMBIGUOUS, None, None, found[0][1], f"several operations: {ids}")
    op, reading = found[0]
    result = result_of(op, reading) if result_of is not None else reading.result
    moved, note = _apply(session, event, op, reading, result, actor=actor, sink=sink, packet=packet)
    disposition = Disposition.SETTLED if moved is not None else Disposition.RECORDED
    return _finish(session, row_id, disposition, op, moved, reading, note)


def _keep(session: Session, event: ReceivedEvent) -> int | None:
    """Insert the event's row; None if it is there already (a retry, or the same event at once)."""
    values = {
        "target": event.target,
        "scope": event.scope or "",
        "verified_by": event.verified_by,
        "event_id": event.event_id,
        "event_type": event.event_type,
        "scheme": event.scheme,
        "received_at": db_now(),
        "signed_at": event.signed_at,
        "body_digest": event.body_digest,
        "tenant": event.scope,
        "disposition": Disposition.RECORDED.value,  # written again once it is applied
    }
    try:
        # A savepoint: the same event delivered twice at once waits on the unique index, then fails here.
        with session.begin_nested():
            return int(session.execute(insert(_EV).values(values).returning(_EV.c.id)).scalar_one())
    except IntegrityError:
        return None


def _duplicate(session: Session, event: ReceivedEvent) -> Received:
    row = session.execute(
        select(WebhookEvent).where(
            WebhookEvent.target == event.target,
            WebhookEvent.verified_by == event.verified_by,
            WebhookEvent.event_id == event.event_id,
        )
    ).scalar_one()
    status = None
    if row.operation_id is not None:
        status = session.execute(select(_OP.c.status).where(_OP.c.id == row.operation_id)).scalar_one_or_none()
    note = f"event {event.event_id} was received before ({row.disposition}): nothing changes"
    return Received(Disposition(row.disposition), True, row.operation_id, status, None, note)


def _operations(session: Session, event: ReceivedEvent) -> list[tuple[Operation, EventReading]]:
    """The operations the event names, each once, with the reading that named it."""
    out: dict[str, tuple[Operation, EventReading]] = {}
    for reading in event.readings:
        named = []
        if reading.provider_key is not None:
            named.append(_OP.c.provider_key == reading.provider_key)
        if reading.reference is not None:
            named.append(_OP.c.result_reference == reading.reference)
        if not named:
            continue
        stmt = select(Operation).where(Operation.action == reading.action, or_(*named))
        if event.scope is not None:
            stmt = stmt.where(Operation.tenant == event.scope)
        elif event.exclude_tenants:
            stmt = stmt.where(Operation.tenant.not_in(list(event.exclude_tenants)))
        for op in session.execute(stmt.limit(10)).scalars():
            out.setdefault(op.id, (op, reading))
    return list(out.values())


def _apply(
    session: Session,
    event: ReceivedEvent,
    op: Operation,
    reading: EventReading,
    result: dict[str, Any] | None,
    *,
    actor: str,
    sink: EvidenceSink,
    packet: PacketBuilder,
) -> tuple[Status | None, str]:
    """(the status it moved the operation to, or None; why) under the operation row's lock."""
    # populate_existing: the row as it is once locked, not as _operations read it before the lock.
    locking = select(Operation).where(Operation.id == op.id).with_for_update()
    locked = session.execute(locking.execution_options(populate_existing=True)).scalar_one()
    status = Status(locked.status)
    said = f"webhook {event.event_type} ({event.event_id}) from {event.target}"
    if reading.outcome is WebhookOutcome.PENDING:
        return None, f"{said}: still pending at the provider; nothing moves (the operation is {status.value})"
    if reading.outcome is WebhookOutcome.SUCCEEDED:
        attempt_id, number = _attempt(session, event, locked, reading, AttemptClass.SUCCEEDED, stale=True)
        late = LateSuccess(
            locked.id,
            attempt_id,
            AttemptKind.LOOKUP.value,
            number,
            locked.fencing_token,
            reading.reference,
            event.body_digest,
        )
        moved = apply_late(
            session,
            late,
            actor=actor,
            sink=sink,
            packet=packet,
            result=result,
            event=EventKind.WEBHOOK,
            why=f"{said} confirmed it",
        )
        if moved is not None:
            return moved, f"{said} confirmed it: {status.value} -> {moved.value}"
        return None, f"{said} confirmed it; the operation is {status.value}: nothing to move"
    # A failure settles nothing by itself: events come in any order (a payment's "failed" can precede
    # its "succeeded"), so the provider's current object is read first (PROVIDERS.md, rule 4).
    return None, _look_now(session, locked, status, said)


def _look_now(session: Session, op: Operation, status: Status, said: str) -> str:
    """A failure event's due: the operation's lookup now, if the reconciler is what settles it (why)."""
    if status in FAILABLE:
        session.execute(
            update(_OP).where(_OP.c.id == op.id, _OP.c.status == status.value).values(next_attempt_at=db_now())
        )
        return (
            f"{said} says it failed: looking it up now before anything moves (events come in any order; "
            f"the operation stays {status.value} until the lookup reads the provider's object)"
        )
    if status is Status.DISPATCHING:
        return (
            f"{said} says it failed while a worker sends it: once the worker leaves it accepted or "
            "outcome_unknown, a lookup reads the provider's object at once"
        )
    if status is Status.RECONCILIATION_REQUIRED and recheck_now(session, op.id):
        return (
            f"{said} says it failed: its handoff is re-checked now (the lookup reads the provider's object and "
            "resolves the case by the provider's evidence)"
        )
    return f"{said} says it failed; the operation is {status.value}, which only its owner moves"


def _attempt(
    session: Session,
    event: ReceivedEvent,
    op: Operation,
    reading: EventReading,
    klass: AttemptClass,
    *,
    stale: bool,
) -> tuple[int, int]:
    """The event's answer as an attempt row (a lookup's: the provider told us what it holds), so the
    guards, the evidence's attempt log and the report read it as any other answer. (id, number)."""
    number = (
        select(func.coalesce(func.max(_AT.c.attempt_number), 0) + 1)
        .where(_AT.c.operation_id == op.id, _AT.c.kind == AttemptKind.LOOKUP.value)
        .scalar_subquery()
    )
    row = session.execute(
        insert(_AT)
        .values(
            operation_id=op.id,
            attempt_number=number,
            kind=AttemptKind.LOOKUP.value,
            fencing_token=op.fencing_token,
            worker=f"webhook:{event.target}",
            started_at=db_now(),
            ended_at=db_now(),
            attempt_class=klass.value,
            provider_request_id=event.event_id,
            provider_reference=reading.reference,
            response_digest=event.body_digest,
            error=None if klass is AttemptClass.SUCCEEDED else f"webhook {event.event_type}",
            stale=stale,
        )
        .returning(_AT.c.id, _AT.c.attempt_number)
    ).one()
    return int(row.id), int(row.attempt_number)


def _finish(
    session: Session,
    row_id: int,
    disposition: Disposition,
    op: Operation | None,
    moved: Status | None,
    reading: EventReading | None,
    note: str,
) -> Received:
    values: dict[str, Any] = {
        "disposition": disposition.value,
        "note": note,
        "moved_to": moved.value if moved else None,
    }
    if reading is not None:
        values.update(
            action=reading.action,
            outcome=reading.outcome.value,
            provider_key=reading.provider_key,
            reference=reading.reference,
        )
    if op is not None:
        values.update(operation_id=op.id, tenant=op.tenant)
    session.execute(update(_EV).where(_EV.c.id == row_id).values(values))
    status = None
    if op is not None:
        status = session.execute(select(_OP.c.status).where(_OP.c.id == op.id)).scalar_one()
    return Received(disposition, False, op.id if op else None, status, moved.value if moved else None, note)
