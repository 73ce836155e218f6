"""Approvals as every surface lists and decides them, for one tenant.

Who may approve is decided once, in outbox/approvals/decisions.py (separate approver, the binding to
the exact arguments); this adds what every surface asked before it: the operation is the caller's
tenant's, and its action has a policy to approve under.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from outbox.access.keys import Caller
from outbox.approvals import decisions
from outbox.approvals.decisions import ApprovalPolicy
from outbox.errors import InvalidIntent
from outbox.ledger.models import Approval, Operation
from outbox.reads.queries import approval_json, operation_json
from outbox.service import operations
from outbox.service.inputs import BY_MAX, NOTE_MAX, written

log = logging.getLogger(__name__)
LIMIT = 500


def pending(session: Session, tenant: str | None, *, limit: int = LIMIT) -> list[Operation]:
    """Operations awaiting a person's approval, oldest first."""
    return decisions.pending(session, tenant=tenant, limit=limit)


def show(session: Session, tenant: str | None, operation_id: str) -> dict[str, Any]:
    """The operation and every decision on it."""
    op = operations.get(session, tenant, operation_id)
    return operation_json(op) | {"approvals": [approval_json(a) for a in decisions.history(session, op.id)]}


def approve(
    session: Session,
    tenant: str | None,
    operation_id: str,
    *,
    by: str,
    note: str | None,
    policies: Mapping[str, ApprovalPolicy],
    identity: str | None = None,
    recorded_as: str | None = None,
) -> Approval:
    """Approve under the action's current policy (``policies``: each action's ``approval:`` rule of
    the actions file); the operation becomes due. ``identity`` and ``recorded_as``: as
    outbox.approvals.decisions.approve has them."""
    written("--by", by, max_len=BY_MAX, required=True)
    written("--note", note, max_len=NOTE_MAX)
    op = operations.get(session, tenant, operation_id)
    policy = policies.get(op.action)
    if policy is None:
        raise InvalidIntent("action", f"{op.action!r} is not in this server's actions file: no policy to approve under")
    row = decisions.approve(
        session,
        op.id,
        by=by,
        note=note,
        policy=policy,
        tenant=tenant,
        identity=identity,
        recorded_as=recorded_as,
    )
    log.info("approved", extra={"operation_id": op.id, "approver": by})
    return row


def deny(
    session: Session, tenant: str | None, operation_id: str, *, by: str, note: str, recorded_as: str | None = None
) -> Approval:
    """Deny: the operation ends cancelled with the reason, nothing sent. ``recorded_as``: how the
    person is written down (``by`` when None)."""
    written("--by", by, max_len=BY_MAX, required=True)
    written("--note", note, max_len=NOTE_MAX, required=True)
    op = operations.get(session, tenant, operation_id)
    row = decisions.deny(session, op.id, by=recorded_as or by, note=note, tenant=tenant)
    log.info("denied", extra={"operation_id": op.id, "approver": by})
    return row


def decide(
    session: Session,
    caller: Caller,
    operation_id: str,
    *,
    approved: bool,
    by: str,
    note: str | None,
    policies: Mapping[str, ApprovalPolicy],
) -> Approval:
    """A decision made with an API key, over HTTP or in a console session of it: in the key's tenant;
    separation of duties compares the key (its identity), not the ``subject`` or ``by`` text a
    request may set; the person is written down as who they said they are and the key that vouches
    for it."""
    vouched = f"{by} (api:key-{caller.key_id})"
    if approved:
        return approve(
            session,
            caller.tenant,
            operation_id,
            by=by,
            note=note,
            policies=policies,
            identity=caller.identity,
            recorded_as=vouched,
        )
    return deny(session, caller.tenant, operation_id, by=by, note=note or "", recorded_as=vouched)
