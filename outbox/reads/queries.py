"""Read-side queries: an operation as every surface shows it (its JSON, attempts, history, approval);
the tenant-scoped use cases built on them are outbox/service/."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from outbox.errors import OperationNotFound
from outbox.ledger.clock import as_utc
from outbox.ledger.drivers.base import Inserted, NewOperation
from outbox.ledger.history import HistoryEvent
from outbox.ledger.models import Approval, Attempt, Operation
from outbox.ledger.states import EventKind


def _iso(value: dt.datetime | None) -> str | None:
    v = as_utc(value)
    return v.isoformat() if v is not None else None


def provider_key_of(op: Operation) -> str:
    """The key the provider saw for this operation (the bare key on rows from before 0005)."""
    return op.provider_key or op.idempotency_key


def operation_json(op: Operation) -> dict[str, Any]:
    """The stable JSON shape of an operation (documented in docs/reference/cli.md; scripts rely on it)."""
    return {
        "operation_id": op.id,
        "tenant": op.tenant,
        "idempotency_key": op.idempotency_key,
        "provider_key": provider_key_of(op),
        "action": op.action,
        "subject": op.subject,
        "submitted_by": op.submitted_by,
        "status": op.status,
        "waiting_for": op.waiting_for,
        "reason": op.reason,
        "attempts": op.attempt_count,
        "max_attempts": op.max_attempts,
        "priority": op.priority,
        "fencing_token": op.fencing_token,
        "result": (
            {"reference": op.result_reference, "digest": op.result_digest, "response": op.result}
            if op.result_reference is not None or op.result is not None
            else None
        ),
        "error_class": op.error_class,
        "last_error": op.last_error,
        "cancel_requested": op.cancel_requested,
        "args_digest": op.args_digest,
        # The definition it was submitted under, and the request its key names: its method, digest and
        # the version it was built under (outbox/ledger/request_record.py; path and body: handoff packets).
        "action_version": op.action_version,
        "request": (
            {"version": op.request_version, "method": op.request_method, "digest": op.request_digest}
            if op.request_version is not None or op.request_digest is not None
            else None
        ),
        "run_id": op.run_id,
        "tool_call_id": op.tool_call_id,
        # Retry as a new intent (outbox/evidence/retries.py): the operation this one replaced, and the one
        # that replaced it.
        "retry_of": op.retry_of,
        "retried_as": op.retried_as,
        "object": op.object_key,
        "budget_scope": op.budget_scope,
        "lease_owner": op.lease_owner,
        "lease_expires_at": _iso(op.lease_expires_at),
        "next_attempt_at": _iso(op.next_attempt_at),
        "deadline_at": _iso(op.deadline_at),
        "created_at": _iso(op.created_at),
        "updated_at": _iso(op.updated_at),
        "finished_at": _iso(op.finished_at),
    }


def attempt_json(a: Attempt) -> dict[str, Any]:
    return {
        "attempt_number": a.attempt_number,
        "kind": a.kind,
        "fencing_token": a.fencing_token,
        "worker": a.worker,
        "class": a.attempt_class,
        "status_code": a.status_code,
        "provider_request_id": a.provider_request_id,
        "provider_reference": a.provider_reference,
        "retry_after_s": a.retry_after_s,
        "latency_s": a.latency_s,
        "request_digest": a.request_digest,
        "response_digest": a.response_digest,
        "error": a.error,
        "stale": a.stale,
        "started_at": _iso(a.started_at),
        "ended_at": _iso(a.ended_at),
    }


def approval_json(a: Approval) -> dict[str, Any]:
    return {
        "approval_id": a.id,
        "operation_id": a.operation_id,
        "tenant": a.tenant,
        "action": a.action,
        "args_digest": a.args_digest,
        "requested_by": a.requested_by,
        "policy_version": a.policy_version,
        "decision": a.decision,
        "approver": a.approver,
        "approver_identity": a.approver_identity,
        "note": a.note,
        "decided_at": _iso(a.decided_at),
        "expires_at": _iso(a.expires_at),
    }


def event_json(e: HistoryEvent) -> dict[str, Any]:
    return {
        "at": _iso(e.at),
        "event": e.event,
        "from": e.from_status,
        "to": e.to_status,
        "fencing_token": e.fencing_token,
        "reason": e.reason,
        "actor": e.actor,
    }


@dataclass(frozen=True)
class OperationDetail:
    operation: Operation
    attempts: list[Attempt]
    events: list[HistoryEvent]
    approvals: list[Approval] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        out = operation_json(self.operation)
        out["attempt_log"] = [attempt_json(a) for a in self.attempts]
        out["history"] = [event_json(e) for e in self.events]
        # The approval this operation was (or was not) sent under: who, when, policy, expiry.
        out["approval"] = approval_json(self.approvals[-1]) if self.approvals else None
        out["timing"] = self.timing()
        return out

    def timing(self) -> dict[str, Any]:
        """Where the time went: waiting in our own queue for a first worker (submit to first
        claim: our backlog, never the provider's fault) and waiting on the provider (the dispatch
        attempts' latencies). None where there is nothing to measure yet."""
        dispatches = [a for a in self.attempts if a.kind == "dispatch"]
        created = as_utc(self.operation.created_at)
        first = as_utc(dispatches[0].started_at) if dispatches else None
        latencies = [a.latency_s for a in dispatches if a.latency_s is not None]
        return {
            "queue_wait_s": round((first - created).total_seconds(), 3) if first and created else None,
            "provider_time_s": round(sum(latencies), 3) if latencies else None,
        }


def submitted_detail(new: NewOperation, inserted: Inserted) -> OperationDetail:
    """A row this very transaction inserted, as a read of it would show it, without reading it: the row
    as submit wrote it (the driver's insert_operation), the times the database gave it, no attempt, no
    approval, one submit event. A submit over HTTP is answered from this (two reads fewer); that it
    equals the read is tests/integration/ledger/test_submitted_answer.py's to show."""
    op = Operation(
        id=new.id,
        tenant=new.tenant,
        idempotency_key=new.idempotency_key,
        provider_key=new.provider_key,
        action=new.action,
        args=new.args,
        args_digest=new.args_digest,
        subject=new.subject,
        submitted_by=new.submitted_by,
        run_id=new.run_id,
        tool_call_id=new.tool_call_id,
        status=new.status.value,
        waiting_for=new.waiting_for.value if new.waiting_for else None,
        reason="submitted",
        attempt_count=0,
        max_attempts=new.max_attempts,
        priority=new.priority,
        fencing_token=0,
        result_reference=None,
        result_digest=None,
        result=None,
        error_class=None,
        last_error=None,
        cancel_requested=False,
        object_key=new.object_key,
        budget_scope=new.budget_scope,
        action_version=new.action_version,
        lease_owner=None,
        lease_expires_at=None,
        next_attempt_at=inserted.next_attempt_at,
        deadline_at=inserted.deadline_at,
        created_at=inserted.created_at,
        updated_at=inserted.updated_at,
        finished_at=None,
    )
    event = HistoryEvent(
        operation_id=new.id,
        at=inserted.created_at,
        event=EventKind.SUBMIT.value,
        from_status=None,
        to_status=new.status.value,
        fencing_token=0,
        reason=new.reason,
        actor=new.subject,
    )
    return OperationDetail(op, [], [event], [])


def find_operation(session: Session, id_or_key: str, *, tenant: str | None = None) -> Operation:
    """By operation id, or by idempotency key (within ``tenant`` if given; must be unambiguous)."""
    stmt = select(Operation).where(or_(Operation.id == id_or_key, Operation.idempotency_key == id_or_key))
    if tenant is not None:
        stmt = stmt.where(or_(Operation.id == id_or_key, Operation.tenant == tenant))
    rows = list(session.execute(stmt.limit(3)).scalars())
    exact = [r for r in rows if r.id == id_or_key]
    if exact:
        return exact[0]
    if not rows:
        raise OperationNotFound(f"no operation with id or idempotency key {id_or_key!r}")
    if len(rows) > 1:
        raise OperationNotFound(f"idempotency key {id_or_key!r} exists in several tenants; pass --tenant")
    return rows[0]


def explain(session: Session, id_or_key: str, *, tenant: str | None = None) -> OperationDetail:
    return detail_of(session, find_operation(session, id_or_key, tenant=tenant))


def detail_of(session: Session, op: Operation) -> OperationDetail:
    """An operation already read, with its attempts and history (indexed reads)."""
    return details_of(session, [op])[0]


def details_of(session: Session, ops: Sequence[Operation]) -> list[OperationDetail]:
    """Several operations' details in three reads whatever their number (a batch submit's answer)."""
    ids = [op.id for op in ops]
    if not ids:
        return []
    attempts: dict[str, list[Attempt]] = {i: [] for i in ids}
    events: dict[str, list[HistoryEvent]] = {i: [] for i in ids}
    approvals: dict[str, list[Approval]] = {i: [] for i in ids}
    for a in session.execute(select(Attempt).where(Attempt.operation_id.in_(ids)).order_by(Attempt.id)).scalars():
        attempts[a.operation_id].append(a)
    for ap in session.execute(select(Approval).where(Approval.operation_id.in_(ids)).order_by(Approval.id)).scalars():
        approvals[ap.operation_id].append(ap)
    for e in session.execute(
        select(HistoryEvent).where(HistoryEvent.operation_id.in_(ids)).order_by(HistoryEvent.id)
    ).scalars():
        events[e.operation_id].append(e)
    return [OperationDetail(op, attempts[op.id], events[op.id], approvals[op.id]) for op in ops]


def count_by_status(session: Session) -> dict[str, int]:
    rows = session.execute(select(Operation.status, func.count()).group_by(Operation.status)).all()
    return {status: int(n) for status, n in rows}
