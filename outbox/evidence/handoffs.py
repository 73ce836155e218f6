"""Handoffs: operations automation could not settle, waiting for a person, and their resolution."""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent, OperationNotFound
from outbox.evidence.settlement import resolve_by_person
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.models import Handoff
from outbox.ledger.states import EventKind, Status
from outbox.ledger.transitions import move

RESOLUTIONS = ("succeeded", "not-executed", "abandoned")


def open_handoff(session: Session, operation_id: str, *, reason: str, packet: dict[str, Any]) -> int:
    """Record the packet for a person (in the transaction that moved the operation)."""
    return int(
        session.execute(
            insert(Handoff)
            .values(operation_id=operation_id, opened_at=db_now(), reason=reason, packet=packet, status="open")
            .returning(Handoff.id)
        ).scalar_one()
    )


def list_handoffs(session: Session, *, status: str | None = "open", limit: int = 100) -> list[Handoff]:
    stmt = select(Handoff)
    if status is not None:
        stmt = stmt.where(Handoff.status == status)
    return list(session.execute(stmt.order_by(Handoff.opened_at, Handoff.id).limit(limit)).scalars())


def get_handoff(session: Session, handoff_id: int) -> Handoff:
    handoff = session.get(Handoff, handoff_id)
    if handoff is None:
        raise OperationNotFound(f"no handoff {handoff_id}")
    return handoff


def resolve(
    session: Session,
    handoff_id: int,
    *,
    resolution: str,
    by: str,
    note: str,
    reference: str | None = None,
) -> Status:
    """A person's decision, written back with who, when and why (also into the operation history).

    succeeded (with the provider reference found) -> the operation succeeds; not-executed -> it is
    re-dispatched with the SAME key; abandoned -> it stays reconciliation_required, closed by a person.
    """
    if resolution not in RESOLUTIONS:
        raise InvalidIntent("--as", f"one of {', '.join(RESOLUTIONS)}")
    if not by or not by.strip():
        raise InvalidIntent("--by", "required: who resolves this handoff")
    if not note or not note.strip():
        raise InvalidIntent("--note", "required: why (what was checked, where)")
    if resolution == "succeeded" and not reference:
        raise InvalidIntent("--reference", "required with --as succeeded: the provider's reference you found")
    handoff = get_handoff(session, handoff_id)
    if handoff.status != "open":
        raise InvalidIntent(
            "ID", f"handoff {handoff_id} was already resolved as {handoff.resolution} by {handoff.resolved_by}"
        )
    if resolution == "abandoned":
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
        .where(Handoff.id == handoff_id, Handoff.status == "open")
        .values(
            status="resolved",
            resolution=resolution,
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
