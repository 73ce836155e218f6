"""Handoffs: operations automation could not settle, waiting for a person, and their resolution."""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent
from outbox.evidence.settlement import resolve_by_person
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.models import Handoff
from outbox.ledger.states import EventKind, HandoffStatus, Resolution, Status
from outbox.ledger.transitions import move


def open_handoff(session: Session, operation_id: str, *, reason: str, packet: dict[str, Any]) -> int:
    """Record the packet for a person (in the transaction that moved the operation)."""
    return int(
        session.execute(
            insert(Handoff)
            .values(
                operation_id=operation_id,
                opened_at=db_now(),
                reason=reason,
                packet=packet,
                status=HandoffStatus.OPEN.value,
            )
            .returning(Handoff.id)
        ).scalar_one()
    )


def resolve(
    session: Session,
    handoff: Handoff,
    *,
    resolution: Resolution | str,
    by: str,
    note: str,
    reference: str | None = None,
) -> Status:
    """A person's decision, written back with who, when and why (also into the operation history).

    succeeded (with the provider reference found) -> the operation succeeds; not-executed -> it is
    re-dispatched with the SAME key; abandoned -> it stays reconciliation_required, closed by a person.
    Which handoff a caller may resolve (its tenant's) is the service's to say (outbox/service/handoffs.py).
    """
    try:
        resolution = Resolution(resolution)
    except ValueError:
        raise InvalidIntent("--as", f"one of {', '.join(r.value for r in Resolution)}") from None
    if not by or not by.strip():
        raise InvalidIntent("--by", "required: who resolves this handoff")
    if not note or not note.strip():
        raise InvalidIntent("--note", "required: why (what was checked, where)")
    if resolution is Resolution.SUCCEEDED and not reference:
        raise InvalidIntent("--reference", "required with --as succeeded: the provider's reference you found")
    if handoff.status != HandoffStatus.OPEN.value:
        raise InvalidIntent(
            "ID", f"handoff {handoff.id} was already resolved as {handoff.resolution} by {handoff.resolved_by}"
        )
    if resolution is Resolution.ABANDONED:
        move(
            session,
            handoff.operation_id,
            sources=[Status.RECONCILIATION_REQUIRED],
            to=Status.RECONCILIATION_REQUIRED,
            event=EventKind.RESOLVED_ABANDONED,
            actor=by,
            reason=f"abandoned by {by}: {note}",
        )
        status = Status.RECONCILIATION_REQUIRED
    else:
        status = resolve_by_person(
            session, handoff.operation_id, outcome=resolution, by=by, note=note, reference=reference
        )
    session.execute(
        update(Handoff)
        .where(Handoff.id == handoff.id, Handoff.status == HandoffStatus.OPEN.value)
        .values(
            status=HandoffStatus.RESOLVED.value,
            resolution=resolution.value,
            resolved_reference=reference,
            resolved_by=by,
            resolved_at=db_now(),
            note=note,
        )
    )
    return status


def handoff_json(h: Handoff) -> dict[str, Any]:
    opened, resolved = as_utc(h.opened_at), as_utc(h.resolved_at)
    return {
        "handoff_id": h.id,
        "operation_id": h.operation_id,
        "status": h.status,
        "reason": h.reason,
        "opened_at": opened.isoformat() if opened else None,
        "resolution": h.resolution,
        "resolved_reference": h.resolved_reference,
        "resolved_by": h.resolved_by,
        "resolved_at": resolved.isoformat() if resolved else None,
        "note": h.note,
        "packet": h.packet,
    }
