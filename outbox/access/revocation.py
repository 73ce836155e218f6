"""Revoking an API key takes back what it may still do, not only its next request.

``revoke`` refuses the key from then on (the API's key cache: within seconds) and, in the same
transaction, takes back the intents it submitted that have not left:

- ``cancel_queued`` (``keys revoke --cancel-queued``): cancelled now, nothing sent; one whose earlier
  attempt may still land keeps the cancel flag (looked up first, cancelled once it provably did not
  happen, as any cancel: outbox/ledger/transitions.py request_cancel);
- otherwise: parked a few seconds (``SETTLE_S``: until every worker has read the revocation,
  outbox/ledger/authority.py), then each goes to a person at its claim ("the submitting key was
  revoked at ...": workers/engine/authority.py).

What comes back to the queue later (a lookup that proves "not sent", an approval) meets the same rule
at its claim. Lookups go on: they read, and settle what may have left. A person who resolves such a
handoff "not executed" after the revocation decides in their own name: it is sent (``decided_after``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent
from outbox.ledger.authority import SETTLE_S, Revocation, board_for, identity_of_key
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.effect_guard import no_effect_possible
from outbox.ledger.events import record_events
from outbox.ledger.models import ApiKey, Handoff, Operation, core_table
from outbox.ledger.states import EventKind, Resolution, Status, WaitingFor, check_allowed

_OP = core_table(Operation)
_KEYS = core_table(ApiKey)
QUEUED = (Status.NOT_DISPATCHED, Status.AWAITING_APPROVAL)
# The moves a revocation makes; the state table must list them.
check_allowed("*", QUEUED, Status.CANCELLED)
check_allowed("*", [Status.NOT_DISPATCHED], Status.NOT_DISPATCHED)


@dataclass(frozen=True)
class Revoked:
    """A revocation and what it did to the key's intents that had not left."""

    key_id: int
    revocation: Revocation
    cancelled: int = 0  # cancelled now, nothing sent (cancel_queued)
    cancel_requested: int = 0  # an earlier attempt may still land: looked up first, then cancelled
    parked: int = 0  # to a person at their claim, within SETTLE_S

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.key_id,
            "revoked_at": self.revocation.at.isoformat(),
            "revoked_by": self.revocation.by,
            "cancel_queued": self.revocation.cancels_queued,
            "cancelled": self.cancelled,
            "cancel_requested": self.cancel_requested,
            "to_a_person": self.parked,
        }


def revoke(
    session: Session, key_id: int, *, by: str | None = None, cancel_queued: bool = False, tenant: str | None = None
) -> Revoked:
    """Revoke key ``key_id`` (``tenant``: only a key of that tenant) and take back its queued intents."""
    row = session.execute(
        update(_KEYS)
        .where(*_active(key_id, tenant))
        .values(revoked_at=db_now(), revoked_by=by, revoke_cancels_queued=cancel_queued)
        .returning(_KEYS.c.revoked_at)
    ).first()
    if row is None:
        raise InvalidIntent("ID", f"no active key {key_id} (agent-outbox keys list)")
    at = as_utc(row.revoked_at)
    assert at is not None
    revocation = Revocation(identity_of_key(key_id), at, by, cancel_queued)
    board_for(session).forget()
    if cancel_queued:
        cancelled, flagged = _cancel_queued(session, revocation)
        return Revoked(key_id, revocation, cancelled=cancelled, cancel_requested=flagged)
    return Revoked(key_id, revocation, parked=_park_queued(session, revocation))


def _active(key_id: int, tenant: str | None) -> list[Any]:
    found = [_KEYS.c.id == key_id, _KEYS.c.revoked_at.is_(None)]
    return found + ([_KEYS.c.tenant == tenant] if tenant is not None else [])


def _cancel_queued(session: Session, revocation: Revocation) -> tuple[int, int]:
    actor = revocation.by or "revocation"
    why = f"cancelled: {revocation.describe()} with --cancel-queued; nothing was sent"
    cancelled = 0
    for source in QUEUED:
        rows = session.execute(
            update(_OP)
            .where(_OP.c.submitted_by == revocation.identity, _OP.c.status == source.value, no_effect_possible())
            .values(
                status=Status.CANCELLED.value,
                cancel_requested=True,
                waiting_for=None,
                reason=why,
                finished_at=db_now(),
                updated_at=db_now(),
            )
            .returning(_OP.c.id, _OP.c.fencing_token)
        ).all()
        record_events(
            session, rows, from_status=source, to=Status.CANCELLED, kind=EventKind.KEY_REVOKED, reason=why, actor=actor
        )
        cancelled += len(rows)
    # An earlier attempt of these may still land: the flag, as for any cancel (looked up, then cancelled).
    later = f"{revocation.describe()} with --cancel-queued; an earlier attempt may still land: looked up first"
    flagged = session.execute(
        update(_OP)
        .where(
            _OP.c.submitted_by == revocation.identity,
            _OP.c.status.in_([s.value for s in QUEUED]),
            _OP.c.cancel_requested.is_(False),
        )
        .values(cancel_requested=True, updated_at=db_now())
        .returning(_OP.c.id, _OP.c.fencing_token, _OP.c.status)
    ).all()
    for source in QUEUED:
        mine = [(r.id, r.fencing_token) for r in flagged if r.status == source.value]
        record_events(
            session, mine, from_status=source, to=source, kind=EventKind.CANCEL_REQUESTED, reason=later, actor=actor
        )
    return cancelled, len(flagged)


def _park_queued(session: Session, revocation: Revocation) -> int:
    why = (
        f"{revocation.describe()}: not sent; to a person at its next claim, once every worker knows (in {SETTLE_S:g}s)"
    )
    rows = session.execute(
        update(_OP)
        .where(_OP.c.submitted_by == revocation.identity, _OP.c.status == Status.NOT_DISPATCHED.value)
        .values(
            next_attempt_at=db_now(SETTLE_S), waiting_for=WaitingFor.AUTHORITY.value, reason=why, updated_at=db_now()
        )
        .returning(_OP.c.id, _OP.c.fencing_token)
    ).all()
    record_events(
        session,
        rows,
        from_status=Status.NOT_DISPATCHED,
        to=Status.NOT_DISPATCHED,
        kind=EventKind.KEY_REVOKED,
        reason=why,
        actor=revocation.by or "revocation",
    )
    return len(rows)


def decided_after(session: Session, asked: Sequence[tuple[str, dt.datetime]]) -> set[str]:
    """Of these (operation id, revocation time): those a person resolved "not executed" after the
    revocation of their submitting key. The person decided in their own name: they are sent."""
    if not asked:
        return set()
    since = dict(asked)
    rows = session.execute(
        select(Handoff.operation_id, func.max(Handoff.resolved_at))
        .where(Handoff.operation_id.in_(list(since)), Handoff.resolution == Resolution.NOT_EXECUTED.value)
        .group_by(Handoff.operation_id)
    ).all()
    out = set()
    for op_id, resolved_at in rows:
        at = as_utc(resolved_at)
        if at is not None and at >= since[op_id]:
            out.add(op_id)
    return out
