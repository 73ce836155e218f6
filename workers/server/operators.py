"""What people call over HTTP (scope ``operate``): handoffs and circuit breakers, as the CLI does.

Handoffs are the key's tenant's only. Breakers belong to targets, which every tenant shares: a
reset (like the CLI's) takes effect for every tenant's operations, so it is an operator's act.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.access.keys import Caller
from outbox.approvals import decisions as approvals
from outbox.errors import InvalidIntent
from outbox.evidence import handoffs
from outbox.evidence.handoffs import RESOLUTIONS
from outbox.ledger.models import Handoff, Operation
from outbox.ledger.submit import require_storable
from outbox.ledger.waits import wake_breaker_waits
from outbox.reads.report_summary import last_report, report_json
from producer.http.auth import require, state
from producer.http.intents import _OPERATION_ID, PROBLEMS
from producer.http.openapi import CONFLICT, NONBLANK, STORABLE, UNCONFIGURED
from producer.http.problems import Problem, not_found

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["operators"])
HandoffId = Annotated[int, Path(ge=1, le=2**63 - 1, description="the handoff's id")]


class ResolveIn(BaseModel):
    # The document says what handoffs.resolve checks: a reference goes with "succeeded".
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={
            "if": {"properties": {"as": {"const": "succeeded"}}},
            "then": {"required": ["reference"], "properties": {"reference": {"type": "string", "minLength": 1}}},
        },
    )

    resolution: str = Field(
        alias="as", description="succeeded | not-executed | abandoned", json_schema_extra={"enum": list(RESOLUTIONS)}
    )
    reference: str | None = Field(
        default=None,
        max_length=255,
        description="the provider's reference (with succeeded)",
        json_schema_extra={"pattern": STORABLE},
    )
    note: str = Field(
        max_length=4000, description="why: what was checked, and where", json_schema_extra={"pattern": NONBLANK}
    )
    by: str = Field(max_length=200, description="who decides", json_schema_extra={"pattern": NONBLANK})


class ResetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = Field(min_length=1, max_length=200, description="who resets", json_schema_extra={"pattern": STORABLE})


def _handoff(session: Session, caller: Caller, handoff_id: int) -> Handoff:
    row = session.execute(
        select(Handoff)
        .join(Operation, Operation.id == Handoff.operation_id)
        .where(Handoff.id == handoff_id, Operation.tenant == caller.tenant)
    ).scalar_one_or_none()
    if row is None:
        raise not_found("handoff")
    return row


@router.get("/handoffs", responses=PROBLEMS)
def list_handoffs(
    request: Request, caller: Annotated[Caller, Depends(require("operate"))], all: bool = False
) -> dict[str, Any]:
    """Open handoffs of this tenant, oldest first (``all=true``: resolved ones too)."""
    stmt = (
        select(Handoff).join(Operation, Operation.id == Handoff.operation_id).where(Operation.tenant == caller.tenant)
    )
    if not all:
        stmt = stmt.where(Handoff.status == "open")
    with state(request).sessions() as session:
        rows = session.execute(stmt.order_by(Handoff.opened_at, Handoff.id).limit(500)).scalars()
        return {"handoffs": [handoffs.handoff_json(h) for h in rows]}


@router.get("/handoffs/{handoff_id}", responses=PROBLEMS)
def get_handoff(handoff_id: HandoffId, request: Request, caller: Annotated[Caller, Depends(require("operate"))]) -> Any:
    """One handoff with its whole packet."""
    with state(request).sessions() as session:
        return handoffs.handoff_json(_handoff(session, caller, handoff_id)) | {
            "packet": _handoff(session, caller, handoff_id).packet
        }


@router.post("/handoffs/{handoff_id}/resolve", responses=PROBLEMS | CONFLICT)
def resolve_handoff(
    handoff_id: HandoffId, body: ResolveIn, request: Request, caller: Annotated[Caller, Depends(require("operate"))]
) -> Any:
    """A person's decision, as ``agent-outbox handoffs resolve``."""
    for name in ("by", "note", "reference"):
        require_storable(name, getattr(body, name))
    with state(request).sessions.begin() as session:
        _handoff(session, caller, handoff_id)
        status = handoffs.resolve(
            session, handoff_id, resolution=body.resolution, by=body.by, note=body.note, reference=body.reference
        )
    with state(request).sessions() as session:
        return handoffs.handoff_json(_handoff(session, caller, handoff_id)) | {"operation_status": status.value}


def _breakers(request: Request) -> tuple[Any, Any]:
    from workers.wiring.runtime import breaker_registry, load_actions_for

    settings = state(request).settings
    actions = load_actions_for(settings)
    return actions, breaker_registry(settings, actions)


@router.get("/reports/latest", responses=PROBLEMS)
def latest_report(request: Request, caller: Annotated[Caller, Depends(require("operate"))]) -> dict[str, Any]:
    """The last reconciliation report kept in the ledger (whichever host ran it): when, whether every
    listing was read, and this tenant's findings and counts."""
    with state(request).sessions() as session:
        row = last_report(session)
        if row is None:
            raise Problem(404, "not-found", "Not found", "no report ran yet: agent-outbox report, or beat's hourly run")
        return report_json(row, tenant=caller.tenant)


@router.get("/breakers", responses=PROBLEMS | UNCONFIGURED)
def list_breakers(request: Request, caller: Annotated[Caller, Depends(require("operate"))]) -> dict[str, Any]:
    """Every target's breaker: state, failures, opened at, reopens at."""
    from breaker.operator import status

    _, registry = _breakers(request)
    try:
        rows = status(registry.redis_url or registry, sorted(registry.configs), registry.namespace)
    finally:
        registry.close()
    return {
        "shared": bool(registry.redis_url),
        "breakers": [
            {
                "target": st.target,
                "state": st.state,
                "failures": st.failures,
                "opened_at": st.opened_at.isoformat() if st.opened_at else None,
                "reopens_at": st.reopens_at.isoformat() if st.reopens_at else None,
            }
            for st in rows
        ],
    }


@router.post("/breakers/{target}/reset", responses=PROBLEMS | CONFLICT | UNCONFIGURED)
def reset_breaker(
    target: str, body: ResetIn, request: Request, caller: Annotated[Caller, Depends(require("operate"))]
) -> dict[str, Any]:
    """Close the target's breaker in every process and wake the operations it parked."""
    from breaker.operator import reset

    require_storable("by", body.by)
    actions, registry = _breakers(request)
    registry.close()
    if target not in registry.configs:
        raise not_found("target")
    if not registry.redis_url:
        raise Problem(
            409, "local-breakers", "No shared breaker", "OUTBOX_REDIS_URL is not set: breakers are per process"
        )
    reset(registry.redis_url, target, by=body.by, namespace=registry.namespace)
    names = sorted(name for name, a in actions.actions.items() if a.target == target)
    woken = 0
    if names:
        with state(request).sessions.begin() as session:
            woken = len(
                wake_breaker_waits(session, names, reason=f"breaker for {target} reset by {body.by}", actor=body.by)
            )
    return {"target": target, "state": "closed", "reset_by": body.by, "woken": woken}


def _waiting_op(session: Session, caller: Caller, operation_id: str) -> Operation:
    op = session.get(Operation, operation_id) if _OPERATION_ID.fullmatch(operation_id) else None
    if op is None or op.tenant != caller.tenant:
        raise not_found("operation")
    return op


class DecisionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = Field(
        min_length=1,
        max_length=200,
        description="who decides (recorded with this key's id)",
        json_schema_extra={"pattern": NONBLANK},
    )
    note: str | None = Field(
        default=None, max_length=4000, description="why (required to deny)", json_schema_extra={"pattern": STORABLE}
    )


@router.get("/approvals", responses=PROBLEMS)
def list_approvals(request: Request, caller: Annotated[Caller, Depends(require("approve"))]) -> dict[str, Any]:
    """This tenant's operations awaiting approval, oldest first."""
    with state(request).sessions() as session:
        return {"approvals": [approvals.pending_json(op) for op in approvals.pending(session, tenant=caller.tenant)]}


@router.post("/approvals/{operation_id}/approve", responses=PROBLEMS | CONFLICT | UNCONFIGURED)
def approve_operation(
    operation_id: str, body: DecisionIn, request: Request, caller: Annotated[Caller, Depends(require("approve"))]
) -> dict[str, Any]:
    """Approve under the action's current policy: the operation becomes due (approval bound to its
    arguments, expiring after the policy's ttl_s)."""
    from workers.wiring.runtime import load_actions_for

    for name in ("by", "note"):
        require_storable(name, getattr(body, name))
    actions = load_actions_for(state(request).settings)
    approver = f"{body.by} (api:key-{caller.key_id})"
    with state(request).sessions.begin() as session:
        op = _waiting_op(session, caller, operation_id)
        known = actions.actions.get(op.action)
        if known is None:
            raise InvalidIntent(
                "action", f"{op.action!r} is not in this server's actions file: no policy to approve under"
            )
        # Separation of duties compares the key (identity), not the `subject` or `by` text a
        # request may set; and `by` may not name the subject either (outbox/approvals/decisions.py).
        row = approvals.approve(
            session,
            op.id,
            by=body.by,
            recorded_as=approver,
            note=body.note,
            policy=known.approval,
            tenant=caller.tenant,
            identity=caller.identity,
        )
        out = approvals.approval_json(row)
    log.info("approved", extra={"operation_id": operation_id, "approver": body.by})
    return out


@router.post("/approvals/{operation_id}/deny", responses=PROBLEMS | CONFLICT)
def deny_operation(
    operation_id: str, body: DecisionIn, request: Request, caller: Annotated[Caller, Depends(require("approve"))]
) -> dict[str, Any]:
    """Deny: the operation ends cancelled with the reason; nothing is sent."""
    for name in ("by", "note"):
        require_storable(name, getattr(body, name))
    with state(request).sessions.begin() as session:
        op = _waiting_op(session, caller, operation_id)
        out = approvals.approval_json(
            approvals.deny(
                session, op.id, by=f"{body.by} (api:key-{caller.key_id})", note=body.note or "", tenant=caller.tenant
            )
        )
    log.info("denied", extra={"operation_id": operation_id, "approver": body.by})
    return out
