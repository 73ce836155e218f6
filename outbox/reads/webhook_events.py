"""The provider's webhook events, read for the reconciliation report: the documents without record.

An event no operation took when it came (``no_operation``, or ``ambiguous``: several operations)
is a document the provider holds and the ledger does not (workers/provider/listing_report.py lists
them beside the listings' own). Each is looked up again when the report runs, by the key and the
reference it carried. One whose operation exists by then is no discrepancy only if that operation
agrees with it: a success event's operation holds the effect, a failure event's is settled (a
lookup read the object after it), a pending one says nothing. An event whose operation exists and
was never brought in line with it (taken up once the reconciler claims it:
outbox/evidence/stored_events.py) is listed, with that operation.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from outbox.actions.webhooks import WebhookOutcome
from outbox.ledger.models import Operation
from outbox.ledger.states import EFFECT, TERMINAL
from outbox.ledger.webhook_models import UNMATCHED, Disposition, WebhookEvent

# One report lists at most this many (the oldest first); the count in the findings says if it was cut.
MAX_DOCUMENTS = 1000


def documents_without_record(session: Session, *, since: dt.datetime) -> list[dict[str, Any]]:
    """Webhook events received since ``since`` that no single operation holds, as the report's
    ``document_without_record`` items (with ``source``: "webhook" and the provider's ``event_id``)."""
    rows = session.execute(
        select(WebhookEvent)
        .where(WebhookEvent.disposition.in_(UNMATCHED), WebhookEvent.received_at >= since)
        .order_by(WebhookEvent.received_at, WebhookEvent.id)
        .limit(MAX_DOCUMENTS)
    ).scalars()
    out = []
    for event in rows:
        ledger = _operations(session, event)
        said = f"webhook {event.event_type} ({event.event_id})"
        if event.disposition == Disposition.NO_OPERATION.value and len(ledger) == 1:
            status = ledger[0]["status"]
            if _agrees(event.outcome, status):
                continue  # its operation exists now, and holds what the event says
            why = f"{said} names operation {ledger[0]['operation_id']} ({status}), which came after it and was never brought in line with it"
        elif not ledger:
            why = f"{said} names no operation"
        else:
            why = f"{said} names several operations"
        out.append(
            {
                "target": event.target,
                "tenant": event.tenant or (ledger[0]["tenant"] if len({r["tenant"] for r in ledger}) == 1 else None),
                "actions": [event.action] if event.action else [],
                "idempotency_key": event.provider_key,
                "reference": event.reference,
                "status": event.event_type,
                "why": why,
                "ledger": ledger,
                "source": "webhook",
                "event_id": event.event_id,
            }
        )
    return out


def _agrees(outcome: str | None, status: str) -> bool:
    """Whether an operation in ``status`` holds what an event of ``outcome`` says (module docstring)."""
    if outcome == WebhookOutcome.SUCCEEDED.value:
        return status in {s.value for s in EFFECT}
    if outcome == WebhookOutcome.FAILED.value:
        return status in {s.value for s in TERMINAL}
    return outcome == WebhookOutcome.PENDING.value


def _operations(session: Session, event: WebhookEvent) -> list[dict[str, Any]]:
    named = []
    if event.provider_key is not None:
        named.append(Operation.provider_key == event.provider_key)
    if event.reference is not None:
        named.append(Operation.result_reference == event.reference)
    if not named:
        return []
    stmt = select(Operation).where(or_(*named))
    if event.action is not None:
        stmt = stmt.where(Operation.action == event.action)
    if event.scope:
        stmt = stmt.where(Operation.tenant == event.scope)
    return [
        {
            "operation_id": op.id,
            "tenant": op.tenant,
            "idempotency_key": op.idempotency_key,
            "provider_key": op.provider_key,
            "action": op.action,
            "status": op.status,
            "reference": op.result_reference,
        }
        for op in session.execute(stmt.limit(10)).scalars()
    ]
