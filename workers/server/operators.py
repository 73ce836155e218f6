"""What people call over HTTP (scope ``operate``, ``approve``): handoffs, reports, breakers and
approvals, as the CLI and the console do (outbox/service/, workers/service/breakers.py).

Handoffs and approvals are the key's tenant's only. Breakers belong to targets, which every tenant
shares: a reset (like the CLI's) takes effect for every tenant's operations, so it is an operator's act.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field

from outbox.access.keys import Caller
from outbox.approvals.decisions import approval_json, pending_json
from outbox.evidence.handoffs import handoff_json
from outbox.ledger.states import PERSON_RESOLUTIONS
from outbox.service import approvals, handoffs, reports
from outbox.service.inputs import BY_MAX, NOTE_MAX, REFERENCE_MAX
from producer.http.auth import require, state
from producer.http.intents import PROBLEMS
from producer.http.openapi import CONFLICT, NONBLANK, STORABLE, UNCONFIGURED, who_field
from producer.http.problems import Problem
from workers.service import breakers
from workers.service.policies import approval_policies

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
        alias="as",
        description="succeeded | not-executed | abandoned | retry-as-new-intent",
        json_schema_extra={"enum": [r.value for r in PERSON_RESOLUTIONS]},
    )
    reference: str | None = Field(
        default=None,
        max_length=REFERENCE_MAX,
        description="the provider's reference (with succeeded)",
        json_schema_extra={"pattern": STORABLE},
    )
    note: str = Field(
        max_length=NOTE_MAX, description="why: what was checked, and where", json_schema_extra={"pattern": NONBLANK}
    )
    by: str = Field(max_length=BY_MAX, description="who decides", json_schema_extra={"pattern": NONBLANK})


class TakeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    over: bool = Field(default=False, description="take over (or release) a case someone else owns")


class ResetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = Field(min_length=1, max_length=BY_MAX, description="who resets", json_schema_extra={"pattern": STORABLE})


class DecisionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = who_field("who decides (recorded with this key's id)")
    note: str | None = Field(
        default=None, max_length=NOTE_MAX, description="why (required to deny)", json_schema_extra={"pattern": STORABLE}
    )


class DenyIn(DecisionIn):
    """A denial: its note is required (the reason the operation ends cancelled), so the document says so."""

    note: str = Field(
        max_length=NOTE_MAX, description="why it is denied (required)", json_schema_extra={"pattern": NONBLANK}
    )


@router.get("/handoffs", responses=PROBLEMS)
def list_handoffs(
    request: Request, caller: Annotated[Caller, Depends(require("operate"))], all: bool = False
) -> dict[str, Any]:
    """Open handoffs of this tenant, oldest first (``all=true``: resolved ones too)."""
    with state(request).sessions() as session:
        rows = handoffs.listing(session, caller.tenant, include_resolved=all)
        return {"handoffs": [handoff_json(*row) for row in rows]}


@router.get("/handoffs/{handoff_id}", responses=PROBLEMS)
def get_handoff(handoff_id: HandoffId, request: Request, caller: Annotated[Caller, Depends(require("operate"))]) -> Any:
    """One handoff with its whole packet."""
    with state(request).sessions() as session:
        return handoff_json(*handoffs.with_operation(session, handoffs.get(session, caller.tenant, handoff_id)))


@router.post("/handoffs/{handoff_id}/take", responses=PROBLEMS | CONFLICT)
def take_handoff(
    handoff_id: HandoffId,
    request: Request,
    caller: Annotated[Caller, Depends(require("operate"))],
    body: TakeIn | None = None,
) -> Any:
    """This key owns the case from now (its ``owner``: ``key:<id>``); ``over``: even when another does."""
    with state(request).sessions.begin() as session:
        row = handoffs.take(session, caller.tenant, handoff_id, identity=caller.identity, over=bool(body and body.over))
        return handoff_json(*row)


@router.post("/handoffs/{handoff_id}/release", responses=PROBLEMS | CONFLICT)
def release_handoff(
    handoff_id: HandoffId,
    request: Request,
    caller: Annotated[Caller, Depends(require("operate"))],
    body: TakeIn | None = None,
) -> Any:
    """Give the case back: nobody owns it (``over``: release another's)."""
    with state(request).sessions.begin() as session:
        row = handoffs.release(
            session, caller.tenant, handoff_id, identity=caller.identity, over=bool(body and body.over)
        )
        return handoff_json(*row)


@router.post("/handoffs/{handoff_id}/resolve", responses=PROBLEMS | CONFLICT)
def resolve_handoff(
    handoff_id: HandoffId, body: ResolveIn, request: Request, caller: Annotated[Caller, Depends(require("operate"))]
) -> Any:
    """A person's decision, as ``agent-outbox handoffs resolve``; ``retry-as-new-intent`` submits the new
    intent (its id: ``retried_as``)."""
    st = state(request)
    with st.sessions.begin() as session:
        status = handoffs.resolve(
            session,
            caller.tenant,
            handoff_id,
            resolution=body.resolution,
            by=body.by,
            note=body.note,
            reference=body.reference,
            rules=st.rules,
            identity=caller.identity,
        )
    with st.sessions() as session:
        row = handoffs.with_operation(session, handoffs.get(session, caller.tenant, handoff_id))
        return handoff_json(*row) | {"operation_status": status.value}


@router.get("/reports/latest", responses=PROBLEMS)
def latest_report(request: Request, caller: Annotated[Caller, Depends(require("operate"))]) -> dict[str, Any]:
    """The last reconciliation report kept in the ledger (whichever host ran it): when, whether every
    listing was read, and this tenant's findings and counts."""
    with state(request).sessions() as session:
        return reports.latest(session, caller.tenant)


@router.get("/breakers", responses=PROBLEMS | UNCONFIGURED)
def list_breakers(request: Request, caller: Annotated[Caller, Depends(require("operate"))]) -> dict[str, Any]:
    """Every target's breaker: state, failures, opened at, reopens at (states null when breakers are
    per process: this server cannot see them)."""
    board = breakers.board(state(request).settings)
    return {
        "shared": board.shared,
        "breakers": [
            {k: row.as_json()[k] for k in ("target", "state", "failures", "opened_at", "reopens_at")}
            for row in board.breakers
        ],
    }


@router.post("/breakers/{target}/reset", responses=PROBLEMS | CONFLICT | UNCONFIGURED)
def reset_breaker(
    target: str, body: ResetIn, request: Request, caller: Annotated[Caller, Depends(require("operate"))]
) -> dict[str, Any]:
    """Close the target's breaker in every process and wake the operations it parked."""
    st = state(request)
    try:
        done = breakers.reset_and_wake(st.settings, breakers.opened(st.sessions), target, by=body.by)
    except breakers.LocalBreakers:
        raise Problem(
            409, "local-breakers", "No shared breaker", "OUTBOX_REDIS_URL is not set: breakers are per process"
        ) from None
    return {"target": done.target, "state": "closed", "reset_by": done.by, "woken": done.woken}


@router.get("/approvals", responses=PROBLEMS)
def list_approvals(request: Request, caller: Annotated[Caller, Depends(require("approve"))]) -> dict[str, Any]:
    """This tenant's operations awaiting approval, oldest first."""
    with state(request).sessions() as session:
        return {"approvals": [pending_json(op) for op in approvals.pending(session, caller.tenant)]}


@router.post("/approvals/{operation_id}/approve", responses=PROBLEMS | CONFLICT | UNCONFIGURED)
def approve_operation(
    operation_id: str, body: DecisionIn, request: Request, caller: Annotated[Caller, Depends(require("approve"))]
) -> dict[str, Any]:
    """Approve under the action's current policy: the operation becomes due (approval bound to its
    arguments, expiring after the policy's ttl_s)."""
    return _decide(request, caller, operation_id, body, approved=True)


@router.post("/approvals/{operation_id}/deny", responses=PROBLEMS | CONFLICT)
def deny_operation(
    operation_id: str, body: DenyIn, request: Request, caller: Annotated[Caller, Depends(require("approve"))]
) -> dict[str, Any]:
    """Deny: the operation ends cancelled with the reason; nothing is sent."""
    return _decide(request, caller, operation_id, body, approved=False)


def _decide(request: Request, caller: Caller, operation_id: str, body: DecisionIn, *, approved: bool) -> dict[str, Any]:
    st = state(request)
    policies = approval_policies(st.settings) if approved else {}
    with st.sessions.begin() as session:
        row = approvals.decide(
            session, caller, operation_id, approved=approved, by=body.by, note=body.note, policies=policies
        )
        return approval_json(row)
