"""Settling the unknown: the ledger side of reconciliation, handoff resolution and evidence backfill.

The reconciler claims an ``outcome_unknown`` operation (``claims.claim_unknown``), asks the
provider, and calls ``settle_if_fenced`` with what the lookup proved. Every move is guarded by
the reconciler's token, and every lookup's answer is kept on its own attempt row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from outbox.errors import IllegalTransition, OperationNotFound, StaleFence
from outbox.ledger.claims import Claim
from outbox.ledger.clock import db_now
from outbox.ledger.drivers import driver_for
from outbox.ledger.drivers.base import FinalizeWrite
from outbox.ledger.effect_guard import no_effect_confirmed
from outbox.ledger.models import Attempt, Operation, core_table
from outbox.ledger.request_record import CLEARED
from outbox.ledger.states import NO_EFFECT, AttemptKind, EventKind, Resolution, Status, WaitingFor
from outbox.ledger.transitions import (
    AttemptReport,
    current_row,
    mark_attempt_stale,
    move,
    record_attempt,
    report_params,
)
from outbox.ledger.writes import SETTLE_WRITES_FOR, released, success_values, waiting_on_entry

_OP = core_table(Operation)
_AT = core_table(Attempt)


def _last_dispatch_number(operation_id: str) -> Any:
    """Every dispatch attempt so far (by row number, refunded ones included) is proven unable to
    take effect (effect_guard.py)."""
    return (
        select(func.coalesce(func.max(_AT.c.attempt_number), 0))
        .where(_AT.c.operation_id == operation_id, _AT.c.kind == AttemptKind.DISPATCH.value)
        .scalar_subquery()
    )


SETTLE_TARGETS = (
    Status.SUCCEEDED,
    Status.COMMITTED_EVIDENCE_DEGRADED,
    Status.FAILED_BEFORE_COMMIT,
    Status.CANCELLED,
    Status.NOT_DISPATCHED,
    Status.OUTCOME_UNKNOWN,
    Status.ACCEPTED,
    Status.FAILED_AT_PROVIDER,
    Status.RECONCILIATION_REQUIRED,
)
# Settlements that schedule another lookup (after ``recheck_in_s``).
RECHECKED = (Status.OUTCOME_UNKNOWN, Status.ACCEPTED)


def settle_if_fenced(
    session: Session,
    claim: Claim,
    report: AttemptReport,
    *,
    to: Status,
    reason: str,
    recheck_in_s: float = 0.0,
    result: dict[str, Any] | None = None,
    cannot_land: bool = False,
    waiting_for: WaitingFor | None = None,
) -> None:
    """Apply what a lookup proved to a reconciler-claimed operation.

    - succeeded / committed_evidence_degraded: the provider has the effect (reference kept);
    - failed_before_commit / cancelled (cancel requested): no effect, and no attempt so far can
      still take effect. The caller has that proof: the provider holds the key as failed, or its
      lookup found nothing and carried our newer token to a provider that fences. Every dispatch
      attempt so far is marked proven unable to land; refused (IllegalTransition) if an attempt
      holds a confirmed success after all;
    - not_dispatched: the lookup found nothing -> re-dispatch with the SAME key (the key makes a
      late arrival of an earlier attempt harmless). ``cannot_land``: the lookup also fenced every
      earlier attempt off, so they are marked proven unable to land; otherwise they stay able to,
      and failed_before_commit stays out of reach until a fence, the provider or a person says so;
    - outcome_unknown: still unknown (pending, lookup down): re-check after ``recheck_in_s``;
    - reconciliation_required: a person must decide (the handoff row is written by the caller);
      ``waiting_for`` says what they are asked for, when more than whether it happened (a decision).
    """
    if claim.kind != AttemptKind.LOOKUP:
        raise ValueError("settle_if_fenced takes a reconciler claim (claims.claim_unknown)")
    if to not in SETTLE_TARGETS:
        raise ValueError(f"cannot settle to {to.value}")
    wrote = record_attempt(session, claim.attempt_id, report)
    values: dict[str, Any] = released()
    extra_where: list[Any] = []
    if to in (Status.SUCCEEDED, Status.COMMITTED_EVIDENCE_DEGRADED):
        values.update(success_values(report.provider_reference, report.response_digest, result))
    elif to in NO_EFFECT:
        # The proof that no attempt so far can take effect, written down so the row explains
        # itself; only a confirmed success on some attempt can still contradict it.
        values.update(proven_absent_through=_last_dispatch_number(claim.operation_id))
        extra_where.append(no_effect_confirmed(excluding_attempt=claim.attempt_id))
    elif to is Status.NOT_DISPATCHED:
        values.update(next_attempt_at=db_now())
        if cannot_land:
            values.update(proven_absent_through=_last_dispatch_number(claim.operation_id))
    elif to in RECHECKED:
        values.update(next_attempt_at=db_now(max(recheck_in_s, 0.0)))
    if to is Status.ACCEPTED:  # the provider's reference and answer, while it finishes
        values.update(success_values(report.provider_reference, report.response_digest, result))
    if to is Status.RECONCILIATION_REQUIRED and waiting_for is not None:
        values.update(waiting_for=waiting_for.value)
    try:
        move(
            session,
            claim.operation_id,
            sources=[claim.status],
            to=to,
            event=EventKind.LOOKUP_RESULT,
            actor=claim.worker,
            reason=reason,
            token=claim.fencing_token,
            extra_where=extra_where,
            event_reason=report.event_reason(f"lookup {claim.attempt_number}", reason),
            **values,
        )
    except StaleFence:
        current = current_row(session, claim.operation_id)
        if (
            extra_where
            and current is not None
            and current.status == claim.status.value
            and current.fencing_token == claim.fencing_token
        ):
            # Still ours: the refusal is the guard (a success is on record), not a lost lease.
            raise IllegalTransition(
                claim.operation_id, f"{claim.status.value} with a confirmed success on record", to.value
            ) from None
        if wrote:
            mark_attempt_stale(session, claim.attempt_id)
        raise


@dataclass(frozen=True)
class SettlementMove:
    """One reconciler-claimed operation's fenced move (what its lookup proved), for
    settle_many_if_fenced."""

    claim: Claim
    report: AttemptReport
    to: Status
    reason: str
    recheck_in_s: float = 0.0
    result: dict[str, Any] | None = None


def settle_many_if_fenced(session: Session, items: Sequence[SettlementMove]) -> list[StaleFence | None]:
    """settle_if_fenced for each item, in the caller's transaction, one statement each (pipelined in
    one round trip on PostgreSQL, as a worker's finalize is); returns each item's refusal.

    Only the settlements without a guard or extra rows (``SETTLE_WRITES_FOR``: succeeded, degraded,
    not_dispatched without fencing earlier attempts off, outcome_unknown): the others go through
    settle_if_fenced. A refusal is a stale token (the lookup row keeps the answer, marked stale).
    """
    for item in items:
        if item.claim.kind != AttemptKind.LOOKUP:
            raise ValueError("settle_many_if_fenced takes reconciler claims (claims.claim_unknown)")
        if item.to not in SETTLE_WRITES_FOR:
            raise ValueError(f"settle {item.to.value} with settle_if_fenced")
    writes = [
        FinalizeWrite(
            item.to,
            refund=False,
            guard=False,
            source=item.claim.status,
            params={
                "reason": item.reason,
                "event_reason": item.report.event_reason(f"lookup {item.claim.attempt_number}", item.reason),
                "event": EventKind.LOOKUP_RESULT.value,
                "actor": item.claim.worker,
                "operation_id": item.claim.operation_id,
                "token": item.claim.fencing_token,
                "attempt_id": item.claim.attempt_id,
                "waiting_for": (w.value if (w := waiting_on_entry(item.to)) else None),
                "delay_s": float(max(item.recheck_in_s, 0.0)) if item.to in RECHECKED else 0.0,
                "result": item.result,
                **report_params(item.report),
            },
        )
        for item in items
    ]
    refusals: list[StaleFence | None] = []
    for item, (wrote, moved) in zip(items, driver_for(session).finalize(session, writes)):
        if moved:
            refusals.append(None)
            continue
        current = current_row(session, item.claim.operation_id)
        if current is None:
            raise OperationNotFound(item.claim.operation_id)
        if wrote:
            mark_attempt_stale(session, item.claim.attempt_id)
        detail = f"now {current.status} with token {current.fencing_token}"
        refusals.append(StaleFence(item.claim.operation_id, item.claim.fencing_token, detail))
    return refusals


def resolve_by_person(
    session: Session,
    operation_id: str,
    *,
    outcome: Resolution | str,
    by: str,
    note: str,
    reference: str | None = None,
) -> Status:
    """A person settles a ``reconciliation_required`` operation.

    ``outcome``: ``succeeded`` (with the provider ``reference`` they found) or ``not-executed``
    (they confirmed nothing happened: re-dispatch with the SAME key).
    """
    outcome = Resolution(outcome)
    if outcome is Resolution.SUCCEEDED:
        if not reference:
            raise ValueError("a succeeded resolution needs the provider reference")
        move(
            session,
            operation_id,
            sources=[Status.RECONCILIATION_REQUIRED],
            to=Status.SUCCEEDED,
            event=EventKind.RESOLVED_SUCCEEDED,
            actor=by,
            reason=note,
            result_reference=reference,
            error_class=None,
        )
        return Status.SUCCEEDED
    if outcome is Resolution.NOT_EXECUTED:
        move(
            session,
            operation_id,
            sources=[Status.RECONCILIATION_REQUIRED],
            to=Status.NOT_DISPATCHED,
            event=EventKind.RESOLVED_NOT_EXECUTED,
            actor=by,
            reason=note,
            proven_absent_through=_last_dispatch_number(operation_id),
            next_attempt_at=db_now(),
            # The provider holds nothing under the key: its next request is the first it sees, built
            # from the definition then current (outbox/ledger/request_record.py).
            **CLEARED,
        )
        return Status.NOT_DISPATCHED
    raise ValueError(f"a person resolves {outcome.value!r} without a move of the operation")


def evidence_backfilled(session: Session, operation_id: str, *, actor: str = "backfill") -> None:
    """committed_evidence_degraded -> succeeded once the evidence record is written."""
    move(
        session,
        operation_id,
        sources=[Status.COMMITTED_EVIDENCE_DEGRADED],
        to=Status.SUCCEEDED,
        event=EventKind.EVIDENCE_BACKFILLED,
        actor=actor,
        reason="evidence record written",
    )
