"""Verified webhook events that came before their operation could take them, taken up once it can.

An event is kept and not applied when it comes (outbox/evidence/webhooks.py) in two cases the
provider will not repair (it got its 200 and never sends the event again):

- it names its operation only by the provider's reference, and the finalize that records that
  reference (a 202's, or a 200's) has not committed yet: kept ``no_operation``;
- it says the effect failed while a worker still sends the request (``dispatching``): kept
  ``recorded``; a failure is confirmed by a lookup, never settled by the event itself.

Both are taken up when the operation comes into the reconciler's hands:

- ``due_now``: a worker's finalize moved operations into accepted / outcome_unknown; one statement
  makes those an event names (by id, or unmatched by its reference or key) due at once, so the
  reconciler's next claim takes them without waiting for the first lookup's settle window;
- ``successes_for``: the reconciler's claimed operations, and the unmatched success events that name
  them (one statement per claim batch); such an event answers the claim instead of a lookup
  (workers/reconcile/stored_events.py), settled through the same fenced path;
- ``mark_applied``: in the settlement's transaction, the event is the operation's from then on
  (``settled``): the report's "document without record" no longer lists it.

An event that came to the target's own endpoint names no operation of a walled tenant (one with an
account or a secret of its own); the caller checks that against the actions file. A failure event
is never settled here either: the lookup the claim makes reads the provider's object.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, exists, or_, select, update
from sqlalchemy.orm import Session

from outbox.actions.webhooks import WebhookOutcome
from outbox.ledger.clock import db_now
from outbox.ledger.models import Operation, core_table
from outbox.ledger.states import Status
from outbox.ledger.webhook_models import Disposition, WebhookEvent

_OP = core_table(Operation)
_EV = core_table(WebhookEvent)
_TAKING = (Status.ACCEPTED.value, Status.OUTCOME_UNKNOWN.value)
_CONCLUSIVE = (WebhookOutcome.SUCCEEDED.value, WebhookOutcome.FAILED.value)


def _unmatched_naming() -> ColumnElement[bool]:
    """An unmatched event of ``_EV`` naming the operation of ``_OP``: same action, its tenant's endpoint
    (or the target's), and its reference or key."""
    return and_(
        _EV.c.disposition == Disposition.NO_OPERATION.value,
        _EV.c.action == _OP.c.action,
        or_(_EV.c.scope == "", _EV.c.scope == _OP.c.tenant),
        or_(_EV.c.reference == _OP.c.result_reference, _EV.c.provider_key == _OP.c.provider_key),
    )


def due_now(session: Session, operation_ids: Sequence[str]) -> list[str]:
    """Of these operations (just moved to accepted / outcome_unknown), those a conclusive event names
    that was never applied (a failure kept while in flight, or an unmatched one): due now. Their ids."""
    if not operation_ids:
        return []
    named = exists().where(
        _EV.c.outcome.in_(_CONCLUSIVE),
        or_(
            and_(_EV.c.operation_id == _OP.c.id, _EV.c.disposition == Disposition.RECORDED.value),
            _unmatched_naming(),
        ),
    )
    stmt = (
        update(_OP)
        .where(_OP.c.id.in_(list(operation_ids)), _OP.c.status.in_(_TAKING), named)
        .values(next_attempt_at=db_now())
        .returning(_OP.c.id)
    )
    return [str(op_id) for op_id in session.execute(stmt).scalars()]


@dataclass(frozen=True)
class StoredSuccess:
    """An unmatched success event naming a claimed operation."""

    row_id: int
    operation_id: str
    target: str
    scope: str  # "" the target's own endpoint, else the tenant's
    event_id: str
    event_type: str
    reference: str | None
    received_at: dt.datetime


def successes_for(session: Session, operation_ids: Sequence[str]) -> list[StoredSuccess]:
    """The unmatched success events that name these operations (one statement), oldest first."""
    if not operation_ids:
        return []
    rows = session.execute(
        select(
            _EV.c.id,
            _OP.c.id.label("operation_id"),
            _EV.c.target,
            _EV.c.scope,
            _EV.c.event_id,
            _EV.c.event_type,
            _EV.c.reference,
            _EV.c.received_at,
        )
        .select_from(_OP.join(_EV, _unmatched_naming()))
        .where(_OP.c.id.in_(list(operation_ids)), _EV.c.outcome == WebhookOutcome.SUCCEEDED.value)
        .order_by(_EV.c.received_at, _EV.c.id)
    ).all()
    return [
        StoredSuccess(
            int(r.id), str(r.operation_id), r.target, r.scope, r.event_id, r.event_type, r.reference, r.received_at
        )
        for r in rows
    ]


def mark_applied(session: Session, row_ids: Sequence[int], *, operation_id: str, tenant: str, moved_to: Status) -> None:
    """These unmatched events settled ``operation_id`` (in the settlement's own transaction)."""
    if not row_ids:
        return
    session.execute(
        update(_EV)
        .where(_EV.c.id.in_(list(row_ids)), _EV.c.disposition == Disposition.NO_OPERATION.value)
        .values(
            disposition=Disposition.SETTLED.value,
            operation_id=operation_id,
            tenant=tenant,
            moved_to=moved_to.value,
            note=f"came before its operation could take it; applied when the reconciler claimed {operation_id}",
        )
    )
