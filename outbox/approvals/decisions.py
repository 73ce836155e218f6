"""Approvals: a person's decision, bound to exactly what was asked, and checked again at the send.

An operation whose action needs approval enters ``awaiting_approval`` at submit; nothing is sent.
``approve`` records who approved, under which policy version, until when, for which args digest and
requesting subject, and makes the operation due; ``deny`` records the denial and cancels it. At the
send (workers/dispatch/fan_out.py, under the claim's fencing token) ``lapse_reason`` checks the approval on
record again: it must exist, be for this operation's args digest and the action's CURRENT policy
version, and be unexpired on the database's clock; otherwise the operation goes back to
``awaiting_approval`` with the reason and nothing is sent. An approval covers its operation only.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent, OperationNotFound, SelfApproval
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.drivers import driver_for
from outbox.ledger.models import Approval, Operation
from outbox.ledger.states import EventKind, Status, WaitingFor
from outbox.ledger.transitions import move
from outbox.reads.queries import approval_json, operation_json


@dataclass(frozen=True)
class Grant:
    """The approval a send relies on (the latest approved decision for the operation)."""

    approval_id: int
    args_digest: str
    policy_version: str
    approver: str
    expires_at: dt.datetime
    # The key that approved (``key:<id>``); an approval given with a key revoked since no longer counts
    # (workers/engine/authority.py). None: a person at the command line.
    approver_identity: str | None = None


def lapse_reason(grant: Grant | None, *, args_digest: str, policy_version: str, now: dt.datetime) -> str | None:
    """Why the approval on record no longer covers the send (None: it does)."""
    if grant is None:
        return f"approval required (policy {policy_version}) and none is on record"
    if grant.args_digest != args_digest:
        return f"approval {grant.approval_id} was given for other arguments"
    if grant.policy_version != policy_version:
        return (
            f"approval {grant.approval_id} was given under policy {grant.policy_version}, "
            f"the action now requires {policy_version}"
        )
    if now >= grant.expires_at:
        return f"approval {grant.approval_id} by {grant.approver} expired at {grant.expires_at.isoformat()}"
    return None


def grants(session: Session, operation_ids: Sequence[str]) -> dict[str, Grant]:
    """The latest approved decision of each operation that has one (one query)."""
    if not operation_ids:
        return {}
    latest = (
        select(Approval.operation_id, func.max(Approval.id).label("id"))
        .where(Approval.operation_id.in_(list(operation_ids)), Approval.decision == "approved")
        .group_by(Approval.operation_id)
        .subquery()
    )
    rows = session.execute(select(Approval).join(latest, Approval.id == latest.c.id)).scalars()
    out = {}
    for a in rows:
        expires = as_utc(a.expires_at)
        assert expires is not None
        out[a.operation_id] = Grant(a.id, a.args_digest, a.policy_version, a.approver, expires, a.approver_identity)
    return out


def _waiting(session: Session, operation_id: str, tenant: str | None) -> Operation:
    op = session.get(Operation, operation_id)
    if op is None or (tenant is not None and op.tenant != tenant):
        raise OperationNotFound(f"no operation {operation_id}")
    if op.status != Status.AWAITING_APPROVAL.value:
        raise InvalidIntent("ID", f"operation {operation_id} is {op.status}, not awaiting_approval")
    return op


def _require(name: str, value: str | None) -> str:
    if not value or not value.strip():
        raise InvalidIntent(name, "required")
    return value.strip()


def _record(
    session: Session,
    op: Operation,
    decision: str,
    *,
    by: str,
    note: str | None,
    policy_version: str,
    ttl_s: float | None,
    identity: str | None = None,
) -> Approval:
    """The decision, bound to what was asked (operation, tenant, action, args digest, subject)."""
    row = Approval(
        operation_id=op.id,
        tenant=op.tenant,
        action=op.action,
        args_digest=op.args_digest,
        requested_by=op.subject,
        policy_version=policy_version,
        decision=decision,
        approver=by,
        approver_identity=identity,
        note=note,
        decided_at=db_now(),
        expires_at=db_now(ttl_s) if ttl_s is not None else None,
    )
    session.add(row)
    session.flush()
    return row


class ApprovalPolicy(Protocol):
    """What an approval is given under: the action's ``approval:`` rule (outbox.actions.specs.ApprovalSpec)."""

    @property
    def policy_version(self) -> str: ...

    @property
    def ttl_s(self) -> float: ...

    @property
    def separate_approver(self) -> bool: ...


def approve(
    session: Session,
    operation_id: str,
    *,
    by: str,
    note: str | None,
    policy: ApprovalPolicy,
    tenant: str | None = None,
    identity: str | None = None,
    recorded_as: str | None = None,
) -> Approval:
    """Record an approval under the action's current ``policy`` and make the operation due.
    ``tenant``: only that tenant's operations. ``identity``: who decides, as the ledger knows them
    (``key:<id>`` for an API key or a console session of it); under ``separate_approver`` it must
    differ from the identity that submitted the intent (``submitted_by``), whatever ``by`` says.
    The free-text ``by`` must also differ from the intent's subject. ``recorded_as``: how the approver is written down (``by`` and
    the key, over the API), ``by`` when None."""
    by = _require("--by", by)
    policy_version, ttl_s = policy.policy_version, policy.ttl_s
    op = _waiting(session, operation_id, tenant)
    if policy.separate_approver:
        if identity is not None and identity == op.submitted_by:
            raise SelfApproval(op.id, identity)
        if by == op.subject:
            raise InvalidIntent("--by", f"{by!r} asked for this intent and cannot approve it (separate_approver)")
    by = recorded_as or by
    row = _record(
        session, op, "approved", by=by, note=note, policy_version=policy_version, ttl_s=ttl_s, identity=identity
    )
    move(
        session,
        op.id,
        sources=[Status.AWAITING_APPROVAL],
        to=Status.NOT_DISPATCHED,
        event=EventKind.APPROVE,
        actor=by,
        reason=f"approved by {by} (approval {row.id}, policy {policy_version}, valid {ttl_s:g}s)"
        + (f": {note}" if note else ""),
        next_attempt_at=db_now(),
        waiting_for=None,
    )
    # Rung on commit like a fresh submit, instead of waiting for the relay's next poll.
    driver_for(session).notify_due(session, op.id)
    return row


def deny(session: Session, operation_id: str, *, by: str, note: str, tenant: str | None = None) -> Approval:
    """Record a denial: the operation ends cancelled, nothing sent."""
    by, note = _require("--by", by), _require("--note", note)
    op = _waiting(session, operation_id, tenant)
    row = _record(session, op, "denied", by=by, note=note, policy_version="-", ttl_s=None)
    move(
        session,
        op.id,
        sources=[Status.AWAITING_APPROVAL],
        to=Status.CANCELLED,
        event=EventKind.DENY,
        actor=by,
        reason=f"approval denied by {by}: {note}",
        cancel_requested=True,
    )
    return row


def pending(session: Session, *, tenant: str | None = None, limit: int = 500) -> list[Operation]:
    stmt = select(Operation).where(
        Operation.status == Status.AWAITING_APPROVAL.value, Operation.waiting_for == WaitingFor.APPROVAL.value
    )
    if tenant is not None:
        stmt = stmt.where(Operation.tenant == tenant)
    return list(session.execute(stmt.order_by(Operation.created_at, Operation.id).limit(limit)).scalars())


def pending_json(op: Operation) -> dict[str, Any]:
    doc = operation_json(op)
    return {k: doc[k] for k in ("operation_id", "tenant", "idempotency_key", "action", "subject", "reason")} | {
        "args_digest": op.args_digest,
        "waiting_since": doc["updated_at"],
    }


def history(session: Session, operation_id: str) -> list[Approval]:
    return list(
        session.execute(select(Approval).where(Approval.operation_id == operation_id).order_by(Approval.id)).scalars()
    )


__all__ = [
    "ApprovalPolicy",
    "Grant",
    "approval_json",
    "approve",
    "deny",
    "grants",
    "history",
    "lapse_reason",
    "pending",
    "pending_json",
]
