"""The reconciliation report, ledger side: what the ledger claims happened, and how healthy it is.

The provider side (listing what the downstream holds) lives in ``workers/provider/listing_report.py``; this module
only reads the ledger, so it needs no actions file and no network.

Health figures, over operations created since the window start:
- failure attributability: of the operations that ended ``failed_before_commit`` or are parked in
  ``reconciliation_required``, the share whose failure names a fault point: an error class, and its
  last failed dispatch attempt names where it failed, by the provider's status code or a transport
  error (``TRANSPORT_ERRORS``: a connect refused, a read timeout). A reason alone ("deadline passed",
  "breaker open") says what the ledger did, not where the call failed;
- auto-recovery rate: of the operations with at least one retryable failed dispatch attempt
  (not_sent / not_processed / ambiguous), the share that later succeeded without a person;
- handoffs opened in the window: open / resolved, and time to resolution (median, max);
- retries: dispatch attempts beyond the first per operation, per action (the caller groups them by
  target); ``billable`` leaves out not_sent attempts, which never left this machine.

And the operations whose own attempts contradict their state (``state_contradictions``), over
operations updated since the window start.
"""

from __future__ import annotations

import datetime as dt
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select, text
from sqlalchemy.orm import Session, aliased

from outbox.evidence.late_successes import CONTRADICTION_EVENT
from outbox.ledger.clock import as_utc
from outbox.ledger.effect_guard import may_still_land
from outbox.ledger.models import OPERATIONS, UNAPPLIED_SUCCESS, Attempt, Handoff, Operation, OperationEvent
from outbox.ledger.states import (
    AWAITING_OUTCOME,
    EFFECT,
    NO_EFFECT,
    AttemptClass,
    AttemptKind,
    HandoffStatus,
    Status,
)

# Statuses in which the ledger holds that the effect exists at the provider.
EFFECT_STATUSES = (Status.SUCCEEDED.value, Status.COMMITTED_EVIDENCE_DEGRADED.value)
ATTRIBUTABLE_STATUSES = (Status.FAILED_BEFORE_COMMIT.value, Status.RECONCILIATION_REQUIRED.value)
RETRYABLE_CLASSES = (AttemptClass.NOT_SENT.value, AttemptClass.NOT_PROCESSED.value, AttemptClass.AMBIGUOUS.value)
# The classes of a failed attempt (not pending, accepted or succeeded).
FAILED_CLASSES = RETRYABLE_CLASSES + (AttemptClass.REJECTED.value,)
# How a worker names a transport failure at the start of its attempt's error (the reasons of
# workers/provider/classify.py's exception table, tests/unit/test_report_figure_rules.py keeps them equal).
TRANSPORT_ERRORS = (
    "connect_timeout",
    "pool_timeout",
    "connect_error",
    "unsupported_protocol",
    "invalid_url",
    "local_protocol_error",
    "write_timeout",
    "write_error",
    "read_timeout",
    "read_error",
    "remote_protocol_error",
    "decoding_error",
    "unexpected_error",
)


@dataclass(frozen=True)
class LedgerRecord:
    """One operation, as much as the comparison with a provider listing needs."""

    operation_id: str
    tenant: str
    idempotency_key: str
    action: str
    status: str
    result_reference: str | None
    created_at: dt.datetime | None
    finished_at: dt.datetime | None
    provider_key: str = ""  # the key the provider saw ("" on records built by hand: the bare key)

    def __post_init__(self) -> None:
        if not self.provider_key:
            object.__setattr__(self, "provider_key", self.idempotency_key)

    def as_json(self) -> dict[str, Any]:
        return {
            "operation_id": self.operation_id,
            "tenant": self.tenant,
            "idempotency_key": self.idempotency_key,
            "provider_key": self.provider_key,
            "action": self.action,
            "status": self.status,
            "reference": self.result_reference,
            "finished_at": _iso(self.finished_at),
        }


def _iso(value: dt.datetime | None) -> str | None:
    v = as_utc(value)
    return v.isoformat() if v is not None else None


def _record(op: Operation) -> LedgerRecord:
    return LedgerRecord(
        op.id,
        op.tenant,
        op.idempotency_key,
        op.action,
        op.status,
        op.result_reference,
        as_utc(op.created_at),
        as_utc(op.finished_at),
        op.provider_key or op.idempotency_key,
    )


def records_with_effect(session: Session, *, actions: Iterable[str], since: dt.datetime) -> list[LedgerRecord]:
    """Operations of ``actions`` the ledger holds as done at the provider, finished since ``since``."""
    names = list(actions)
    if not names:
        return []
    rows = session.execute(
        select(Operation)
        .where(Operation.action.in_(names), Operation.status.in_(EFFECT_STATUSES), Operation.finished_at >= since)
        .order_by(Operation.finished_at)
    ).scalars()
    return [_record(op) for op in rows]


def records_by_key(session: Session, *, actions: Iterable[str], keys: Iterable[str]) -> dict[str, list[LedgerRecord]]:
    """Every operation (any age, any status) of ``actions`` whose provider key is one of ``keys``,
    by provider key (the key a provider lists is the one it saw, tenant scope included)."""
    names, wanted = list(actions), sorted(set(keys))
    out: dict[str, list[LedgerRecord]] = defaultdict(list)
    # Chunked IN lists: a listing can hold thousands of keys.
    for i in range(0, len(wanted), 500):
        rows = session.execute(
            select(Operation).where(Operation.action.in_(names), Operation.provider_key.in_(wanted[i : i + 500]))
        ).scalars()
        for op in rows:
            rec = _record(op)
            out[rec.provider_key].append(rec)
    return dict(out)


def records_by_reference(
    session: Session, *, actions: Iterable[str], references: Iterable[str]
) -> dict[str, LedgerRecord]:
    """Operations of ``actions`` whose recorded provider reference is one of ``references``."""
    names, wanted = list(actions), sorted(set(references))
    out: dict[str, LedgerRecord] = {}
    for i in range(0, len(wanted), 500):
        rows = session.execute(
            select(Operation).where(Operation.action.in_(names), Operation.result_reference.in_(wanted[i : i + 500]))
        ).scalars()
        for op in rows:
            if op.result_reference is not None:
                out[op.result_reference] = _record(op)
    return out


def names_a_fault_point(status_code: int | None, error: str | None) -> bool:
    """A failed attempt says where it failed: the provider's status code, or a transport error."""
    if status_code is not None:
        return True
    head = (error or "").split(":", 1)[0].strip()
    return head in TRANSPORT_ERRORS


def failure_attributability(session: Session, *, since: dt.datetime) -> dict[str, Any]:
    """The module docstring's figure: one read of the failures, one of their failed dispatch attempts."""
    rows = session.execute(
        select(Operation.id, Operation.error_class).where(
            Operation.status.in_(ATTRIBUTABLE_STATUSES), Operation.created_at >= since
        )
    ).all()
    last_failed: dict[str, tuple[int | None, str | None]] = {}
    ids = [r.id for r in rows if r.error_class]
    for i in range(0, len(ids), 500):
        for a in session.execute(
            select(Attempt.operation_id, Attempt.status_code, Attempt.error)
            .where(
                Attempt.operation_id.in_(ids[i : i + 500]),
                Attempt.kind == AttemptKind.DISPATCH.value,
                Attempt.attempt_class.in_(FAILED_CLASSES),
            )
            .order_by(Attempt.operation_id, Attempt.attempt_number)
        ).all():
            last_failed[a.operation_id] = (a.status_code, a.error)  # the last one read wins
    attributable = sum(1 for r in rows if r.error_class and names_a_fault_point(*last_failed.get(r.id, (None, None))))
    return {
        "operations": len(rows),
        "attributable": attributable,
        "share": round(attributable / len(rows), 4) if rows else None,
    }


def auto_recovery(session: Session, *, since: dt.datetime) -> dict[str, Any]:
    retried = (
        select(Attempt.operation_id)
        .join(Operation, Operation.id == Attempt.operation_id)
        .where(
            Attempt.kind == AttemptKind.DISPATCH.value,
            Attempt.attempt_class.in_(RETRYABLE_CLASSES),
            Operation.created_at >= since,
        )
        .distinct()
    )
    ids = list(session.execute(retried).scalars())
    if not ids:
        return {"operations": 0, "recovered": 0, "rate": None}
    by_person = set(
        session.execute(
            select(OperationEvent.operation_id)
            .where(OperationEvent.operation_id.in_(ids), OperationEvent.event.like("resolved:%"))
            .distinct()
        ).scalars()
    )
    succeeded = set(
        session.execute(
            select(Operation.id).where(Operation.id.in_(ids), Operation.status.in_(EFFECT_STATUSES))
        ).scalars()
    )
    recovered = len(succeeded - by_person)
    return {"operations": len(ids), "recovered": recovered, "rate": round(recovered / len(ids), 4)}


def handoff_figures(session: Session, *, since: dt.datetime) -> dict[str, Any]:
    rows = session.execute(
        select(Handoff.status, Handoff.opened_at, Handoff.resolved_at).where(Handoff.opened_at >= since)
    ).all()
    durations = []
    for r in rows:
        opened, resolved = as_utc(r.opened_at), as_utc(r.resolved_at)
        if r.status == HandoffStatus.RESOLVED.value and opened is not None and resolved is not None:
            durations.append((resolved - opened).total_seconds())
    return {
        "open": sum(1 for r in rows if r.status == HandoffStatus.OPEN.value),
        "resolved": sum(1 for r in rows if r.status == HandoffStatus.RESOLVED.value),
        "time_to_resolution_s": {
            "median": round(statistics.median(durations), 3) if durations else None,
            "max": round(max(durations), 3) if durations else None,
        },
    }


def retries_by_action(session: Session, *, since: dt.datetime) -> dict[str, dict[str, int]]:
    """{action: {"retries": n, "billable": m}}: dispatch attempts numbered 2 and up."""
    rows = session.execute(
        select(Operation.action, Attempt.attempt_class, func.count())
        .join(Operation, Operation.id == Attempt.operation_id)
        .where(Attempt.kind == AttemptKind.DISPATCH.value, Attempt.attempt_number > 1, Operation.created_at >= since)
        .group_by(Operation.action, Attempt.attempt_class)
    ).all()
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"retries": 0, "billable": 0})
    for action, klass, n in rows:
        out[action]["retries"] += int(n)
        if klass != AttemptClass.NOT_SENT.value:
            out[action]["billable"] += int(n)
    return dict(out)


def operations_in_window(session: Session, *, since: dt.datetime) -> int:
    return int(
        session.execute(select(func.count()).select_from(Operation).where(Operation.created_at >= since)).scalar_one()
    )


# Attempts as ``a``, so the guards' own SQL (effect_guard.py, models.UNAPPLIED_SUCCESS) reads them.
_A = aliased(Attempt, name="a")
_SUCCESS = _A.attempt_class == AttemptClass.SUCCEEDED.value
# (statuses, attempt condition, why): an attempt of the operation that its state denies.
CONTRADICTIONS: tuple[tuple[frozenset[Status], Any, str], ...] = (
    (NO_EFFECT, _SUCCESS, "the provider confirmed an effect on this attempt, the state says none happened"),
    (NO_EFFECT, text(may_still_land(OPERATIONS)), "ended with no effect while this attempt may still take effect"),
    (
        AWAITING_OUTCOME,
        text(UNAPPLIED_SUCCESS),
        "the provider confirmed an effect on this attempt, not yet applied (the relay's sweep applies it)",
    ),
    (
        EFFECT,
        and_(
            _SUCCESS,
            _A.provider_reference.is_not(None),
            Operation.result_reference.is_not(None),
            _A.provider_reference != Operation.result_reference,
        ),
        "this attempt's confirmation names another reference: a second effect at the provider?",
    ),
)


def state_contradictions(session: Session, *, since: dt.datetime) -> list[dict[str, Any]]:
    """Operations whose attempts contradict their state, and those flagged earlier for it.

    Each item: the operation (as LedgerRecord.as_json), ``why``, and the ``attempt`` that
    contradicts it (number, kind, token, class, reference, stale) or None for a flagged one
    (``late evidence contradicts`` in its history: it once said "no effect" and then the provider
    confirmed one; a person reviews it through its handoff).
    """
    out: list[dict[str, Any]] = []
    for statuses, condition, why in CONTRADICTIONS:
        rows = session.execute(
            select(Operation, _A)
            .join(_A, _A.operation_id == Operation.id)
            .where(Operation.status.in_([s.value for s in statuses]), Operation.updated_at >= since, condition)
            .order_by(Operation.updated_at, _A.id)
        ).all()
        for op, a in rows:
            out.append(
                _record(op).as_json()
                | {
                    "why": why,
                    "attempt": {
                        "attempt_number": a.attempt_number,
                        "kind": a.kind,
                        "fencing_token": a.fencing_token,
                        "class": a.attempt_class,
                        "reference": a.provider_reference,
                        "stale": a.stale,
                    },
                }
            )
    flagged = session.execute(
        select(Operation, OperationEvent.reason)
        .join(OperationEvent, OperationEvent.operation_id == Operation.id)
        .where(
            OperationEvent.event == CONTRADICTION_EVENT, or_(OperationEvent.at >= since, Operation.updated_at >= since)
        )
        .order_by(OperationEvent.at)
    ).all()
    for op, reason in flagged:
        out.append(_record(op).as_json() | {"why": f"flagged: {reason}", "attempt": None})
    return out
