"""Handoffs: operations automation could not settle, waiting for a person, and their resolution.

A handoff is a case: a person takes it (its ``owner``, an identity as separation of duties compares
them: ``key:<id>`` for an API key or a console session of it, ``cli:<account>`` for the command line,
never free text), and while it waits, the reconciler goes on asking the provider when the answer could
settle it (``next_check_at``: outbox/evidence/checks.py, outbox/evidence/rechecks.py). What the
provider says closes it (``close_by_evidence``: a re-check, a late success, a webhook), with the
attempt that holds the evidence; a person's decision closes it with who, when and why.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent
from outbox.evidence.checks import Recheck, first_sent_at
from outbox.evidence.settlement import resolve_by_person
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.events import record_events
from outbox.ledger.models import Handoff, Operation, core_table
from outbox.ledger.states import EventKind, HandoffStatus, Resolution, Status
from outbox.ledger.transitions import move
from outbox.ledger.writes import released

_OP = core_table(Operation)


def open_handoff(
    session: Session, operation_id: str, *, reason: str, packet: dict[str, Any], recheck: Recheck | None = None
) -> int:
    """Record the packet for a person (in the transaction that moved the operation). ``recheck``: the
    provider's answer could still settle it, so the reconciler looks it up again, first after
    ``recheck.first_s``, until ``recheck.horizon_s`` after the first attempt that may have reached
    the provider (None: a person's decision by design, nothing to look up)."""
    values: dict[str, Any] = {}
    if recheck is not None:
        now = as_utc(session.execute(select(db_now())).scalar_one())
        assert now is not None
        until = (first_sent_at(session, operation_id) or now) + dt.timedelta(seconds=recheck.horizon_s)
        if until > now:  # else the provider forgot the key already: a lookup by it proves nothing now
            values = {"checks_until": until, "next_check_at": min(now + dt.timedelta(seconds=recheck.first_s), until)}
    return int(
        session.execute(
            insert(Handoff)
            .values(
                operation_id=operation_id,
                opened_at=db_now(),
                reason=reason,
                packet=packet,
                status=HandoffStatus.OPEN.value,
                **values,
            )
            .returning(Handoff.id)
        ).scalar_one()
    )


def close_by_evidence(
    session: Session,
    operation_id: str,
    *,
    resolution: Resolution,
    reference: str | None,
    actor: str,
    note: str,
    attempt_id: int | None,
) -> int | None:
    """Close the operation's open handoff as the provider's evidence says (in the transaction that
    moved the operation): ``attempt_id``, the attempt row that holds that evidence. Returns its id."""
    return session.execute(
        update(Handoff)
        .where(Handoff.operation_id == operation_id, Handoff.status == HandoffStatus.OPEN.value)
        .values(
            status=HandoffStatus.RESOLVED.value,
            resolution=resolution.value,
            resolved_reference=reference,
            resolved_by=actor,
            resolved_at=db_now(),
            note=note,
            next_check_at=None,
            evidence_attempt_id=attempt_id,
        )
        .returning(Handoff.id)
    ).scalar()


def locked(session: Session, handoff: Handoff) -> Handoff:
    """The handoff as it is now, its operation's row locked first (the order every move that closes a
    handoff takes: a re-check, a late success, a webhook), so a decision and the provider's evidence
    never both win."""
    session.execute(select(_OP.c.id).where(_OP.c.id == handoff.operation_id).with_for_update())
    fresh = session.get(Handoff, handoff.id, populate_existing=True)
    assert fresh is not None
    return fresh


def refuse_closed(handoff: Handoff) -> None:
    if handoff.status != HandoffStatus.OPEN.value:
        how = "by the provider's evidence" if handoff.evidence_attempt_id is not None else f"by {handoff.resolved_by}"
        raise InvalidIntent("ID", f"handoff {handoff.id} was already resolved as {handoff.resolution} {how}")


def take(session: Session, handoff: Handoff, *, identity: str, over: bool = False) -> Handoff:
    """``identity`` owns the case from now (``over``: even when another does; the history says whose it
    was). Nothing about the operation moves; its history records who took it."""
    handoff = locked(session, handoff)
    refuse_closed(handoff)
    before = handoff.owner
    if before == identity:
        return handoff
    if before is not None and not over:
        raise InvalidIntent("ID", f"handoff {handoff.id} is owned by {before}: take it over with --over")
    session.execute(update(Handoff).where(Handoff.id == handoff.id).values(owner=identity, taken_at=db_now()))
    _record(
        session,
        handoff,
        EventKind.HANDOFF_TAKEN,
        identity,
        f"taken by {identity}" + (f" from {before}" if before else ""),
    )
    return handoff


def release(session: Session, handoff: Handoff, *, identity: str, over: bool = False) -> Handoff:
    """Give the case back: unowned again (``over``: someone else's)."""
    handoff = locked(session, handoff)
    refuse_closed(handoff)
    before = handoff.owner
    if before is None:
        raise InvalidIntent("ID", f"handoff {handoff.id} has no owner")
    if before != identity and not over:
        raise InvalidIntent("ID", f"handoff {handoff.id} is owned by {before}, not {identity}: release it with --over")
    session.execute(update(Handoff).where(Handoff.id == handoff.id).values(owner=None, taken_at=None))
    _record(
        session,
        handoff,
        EventKind.HANDOFF_RELEASED,
        identity,
        f"released by {identity}" + (f" for {before}" if before != identity else ""),
    )
    return handoff


def _record(session: Session, handoff: Handoff, kind: EventKind, actor: str, reason: str) -> None:
    token = session.execute(select(_OP.c.fencing_token).where(_OP.c.id == handoff.operation_id)).scalar_one()
    record_events(
        session,
        [(handoff.operation_id, int(token))],
        from_status=Status.RECONCILIATION_REQUIRED,
        to=Status.RECONCILIATION_REQUIRED,
        kind=kind,
        reason=f"handoff {handoff.id} {reason}",
        actor=actor,
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
    re-dispatched with the SAME key; abandoned -> it ends abandoned: nothing more is sent or looked up
    under its key, and a confirmation from the provider still settles it. Retry as a new intent is
    outbox/evidence/retries.py. Which handoff a caller may resolve (its tenant's) is the service's to
    say (outbox/service/handoffs.py).
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
    if resolution not in (Resolution.SUCCEEDED, Resolution.NOT_EXECUTED, Resolution.ABANDONED):
        raise InvalidIntent("--as", f"{resolution.value} is not resolved here (outbox/evidence/retries.py)")
    handoff = locked(session, handoff)
    refuse_closed(handoff)
    if resolution is Resolution.ABANDONED:
        # An end that claims nothing. The token moves on: a re-check in flight finds its claim stale.
        move(
            session,
            handoff.operation_id,
            sources=[Status.RECONCILIATION_REQUIRED],
            to=Status.ABANDONED,
            event=EventKind.RESOLVED_ABANDONED,
            actor=by,
            reason=f"abandoned by {by}: {note}",
            fencing_token=_OP.c.fencing_token + 1,
            **released(),
        )
        status = Status.ABANDONED
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
            next_check_at=None,
        )
    )
    return status


def _iso(value: dt.datetime | None) -> str | None:
    v = as_utc(value)
    return v.isoformat() if v is not None else None


def handoff_json(h: Handoff, op: Operation | None = None) -> dict[str, Any]:
    """The stable JSON shape of a handoff (``op``: its operation, for the two ends of a retry)."""
    doc: dict[str, Any] = {
        "handoff_id": h.id,
        "operation_id": h.operation_id,
        "status": h.status,
        "reason": h.reason,
        "opened_at": _iso(h.opened_at),
        "owner": h.owner,
        "taken_at": _iso(h.taken_at),
        "next_check_at": _iso(h.next_check_at),
        "checks_until": _iso(h.checks_until),
        "resolution": h.resolution,
        "resolved_reference": h.resolved_reference,
        "resolved_by": h.resolved_by,
        "resolved_at": _iso(h.resolved_at),
        "resolved_by_evidence": h.evidence_attempt_id is not None,
        "evidence_attempt_id": h.evidence_attempt_id,
        "note": h.note,
        "packet": h.packet,
    }
    if op is not None:
        doc |= {"operation_status": op.status, "retry_of": op.retry_of, "retried_as": op.retried_as}
    return doc
