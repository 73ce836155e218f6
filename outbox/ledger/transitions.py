"""Every transition of the state machine as one guarded UPDATE plus the row that records why.

Worker-side transitions are fenced: ``WHERE id = ? AND status = ? AND fencing_token = ?``. A worker
whose token is stale matches no row and gets ``StaleFence``; its attempt's evidence is still kept
(``finalize_if_fenced`` writes the attempt row first and marks it stale). The caller owns the
transaction: catch ``StaleFence`` inside ``with session.begin():`` to commit that evidence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import IllegalTransition, OperationNotFound, OutboxError, StaleFence
from outbox.ledger.claims import Claim
from outbox.ledger.clock import db_now
from outbox.ledger.drivers import FinalizeWrite, driver_for
from outbox.ledger.effect_guard import no_effect_possible
from outbox.ledger.events import record_events
from outbox.ledger.models import Attempt, Operation, core_table
from outbox.ledger.request_record import NO_RECORD, RequestRecord
from outbox.ledger.states import (
    EFFECT,
    NO_EFFECT,
    PROVABLY_NOT_EXECUTED,
    TERMINAL,
    AttemptClass,
    EventKind,
    Status,
    WaitingFor,
    check_allowed,
)
from outbox.ledger.writes import ATTEMPT_REPORT, core_values, waiting_on_entry

_OP = core_table(Operation)
_AT = core_table(Attempt)


@dataclass(frozen=True)
class AttemptReport:
    """What one attempt proved, as the worker saw it. Written once to the attempt row."""

    klass: AttemptClass
    status_code: int | None = None
    request_digest: str | None = None
    provider_request_id: str | None = None
    provider_reference: str | None = None
    response_digest: str | None = None
    retry_after_s: float | None = None
    latency_s: float | None = None
    error: str | None = None
    # A declared limit the attempt waited for before it left ("waited 0.420s for the rate limit of
    # target payments: 50/s"): said in its event, which people read in the history (ops show).
    waited: str | None = None
    # The request this attempt sent, when it may have left (outbox/ledger/request_record.py): recorded
    # on the operation by its finalize if none is on record yet. Not part of the attempt row.
    sent: RequestRecord | None = None

    def event_reason(self, label: str, reason: str) -> str:
        """The reason of this attempt's event in the history (``label``: "attempt 3", "lookup 2")."""
        said = f"{label} {self.klass.value}: {reason}"
        return f"{said} ({self.waited})" if self.waited else said


def move(
    session: Session,
    operation_id: str,
    *,
    sources: Iterable[Status],
    to: Status,
    event: EventKind,
    actor: str,
    reason: str | None = None,
    token: int | None = None,
    extra_where: Iterable[Any] = (),
    event_reason: str | None = None,
    **values: Any,
) -> tuple[str | None, int]:
    """Move one operation from one of ``sources`` to ``to`` if the guards hold.

    ``event_reason``: the event row's reason when it should say more than the operation's
    (which attempt decided the move). Returns (previous status, token). Raises ``StaleFence`` when a token was given and the row does
    not match it (or its status moved on), ``IllegalTransition``/``OperationNotFound`` otherwise.
    """
    srcs = list(sources)
    check_allowed(operation_id, srcs, to)
    conds = [_OP.c.id == operation_id, _OP.c.status.in_([s.value for s in srcs]), *extra_where]
    if token is not None:
        conds.append(_OP.c.fencing_token == token)
    values.setdefault("updated_at", db_now())
    values.setdefault("reason", reason or event.value)
    if "waiting_for" not in values:
        waiting = waiting_on_entry(to)
        values["waiting_for"] = waiting.value if waiting else None
    if to in TERMINAL:
        values.setdefault("finished_at", db_now())
    previous: str | None = srcs[0].value if len(srcs) == 1 else None
    if previous is None:
        # Several possible sources (cancel, person's resolution): read which one, row locked.
        lock = select(_OP.c.status).where(_OP.c.id == operation_id)
        previous = session.execute(lock.with_for_update()).scalar_one_or_none()
    row = session.execute(
        update(_OP).where(*conds).values(status=to.value, **values).returning(_OP.c.fencing_token)
    ).first()
    if row is None:
        current = current_row(session, operation_id)
        if current is None:
            raise OperationNotFound(operation_id)
        if token is not None:
            raise StaleFence(operation_id, token, f"now {current.status} with token {current.fencing_token}")
        raise IllegalTransition(operation_id, current.status, to.value)
    record_events(
        session,
        [(operation_id, row.fencing_token)],
        from_status=previous,
        to=to,
        kind=event,
        reason=event_reason or reason,
        actor=actor,
    )
    return previous, int(row.fencing_token)


def record_attempt(session: Session, attempt_id: int, report: AttemptReport, *, stale: bool = False) -> bool:
    """Write an attempt's result once. Returns False if it was already written (never overwrite)."""
    row = session.execute(_record_attempt_stmt(attempt_id, report, stale=stale)).first()
    return row is not None


def _record_attempt_stmt(attempt_id: int, report: AttemptReport, *, stale: bool = False) -> Any:
    return (
        update(_AT)
        .where(_AT.c.id == attempt_id, _AT.c.ended_at.is_(None))
        .values(**core_values(ATTEMPT_REPORT, {**report_params(report), "stale": stale}, _AT))
        .returning(_AT.c.id)
    )


def finalize_if_fenced(
    session: Session,
    claim: Claim,
    report: AttemptReport,
    *,
    to: Status,
    reason: str,
    delay_s: float = 0.0,
    refund_attempt: bool = False,
    result: dict[str, Any] | None = None,
    waiting_for: WaitingFor = WaitingFor.BACKOFF,
) -> None:
    """Record the attempt, then move the claimed operation to ``to`` under its token.

    ``to`` is one of: succeeded, committed_evidence_degraded (2xx), not_dispatched (retry after
    ``delay_s``, waiting for ``waiting_for``; ``refund_attempt`` when nothing was sent, e.g. breaker
    open), failed_before_commit or cancelled (only with a provably-not-executed class, and only while no other attempt may
    have taken effect: effect_guard.py), outcome_unknown (ambiguous).
    Raises StaleFence (the attempt row still holds the result, marked stale) or IllegalTransition.
    """
    (refused,) = finalize_many_if_fenced(
        session, [Finalize(claim, report, to, reason, delay_s, refund_attempt, result, waiting_for)]
    )
    if refused is not None:
        raise refused


@dataclass(frozen=True)
class Finalize:
    """One claimed attempt's end, for finalize_many_if_fenced (arguments as finalize_if_fenced)."""

    claim: Claim
    report: AttemptReport
    to: Status
    reason: str
    delay_s: float = 0.0
    refund_attempt: bool = False
    result: dict[str, Any] | None = None
    # What a not_dispatched operation waits for until its next attempt (breaker, backoff, Retry-After).
    waiting_for: WaitingFor = WaitingFor.BACKOFF


def finalize_many_if_fenced(session: Session, items: Sequence[Finalize]) -> list[OutboxError | None]:
    """finalize_if_fenced for each item, in the caller's transaction; returns each item's refusal.

    None = moved; otherwise the StaleFence or IllegalTransition that refused only that item's
    operation (its attempt evidence is still written). On PostgreSQL the statements are sent in
    one pipeline: one round trip for the whole doorbell batch instead of one per operation.
    """
    refusals: list[OutboxError | None] = [None] * len(items)
    ready: list[int] = []
    for i, item in enumerate(items):
        try:
            check_allowed(item.claim.operation_id, [Status.DISPATCHING], item.to)
        except IllegalTransition as exc:
            refusals[i] = exc
            continue
        if item.to in NO_EFFECT and item.report.klass not in PROVABLY_NOT_EXECUTED:
            refusals[i] = IllegalTransition(
                item.claim.operation_id, "dispatching/" + item.report.klass.value, item.to.value
            )
        else:
            ready.append(i)
    outcomes = _finalize(session, [items[i] for i in ready])
    for i, (wrote, refused) in zip(ready, outcomes):
        if refused is None:
            continue
        item = items[i]
        if item.report.sent is not None:
            # Refused (its lease lost, or the guard): what it sent is still a fact about the provider,
            # recorded if nothing is yet (first wins, never overwritten: the driver's record_request).
            sent = _recorded(item.report.sent, item.to)
            driver_for(session).record_request(session, item.claim.operation_id, sent.params())
        if item.to in NO_EFFECT and _still_ours(session, item.claim):
            # The token is current: the refusal is the ledger's own guard, not a lost lease.
            refusals[i] = IllegalTransition(
                item.claim.operation_id, "dispatching with an attempt that may have taken effect", item.to.value
            )
            continue
        if wrote:
            mark_attempt_stale(session, item.claim.attempt_id)
        refusals[i] = refused
    return refusals


def _finalize(session: Any, items: Sequence[Finalize]) -> list[tuple[bool, OutboxError | None]]:
    """Each item's attempt row, fenced move and its event in the history (the driver pipelines them where it can)."""
    writes = [_finalize_write(item) for item in items]
    out: list[tuple[bool, OutboxError | None]] = []
    for item, (wrote, moved) in zip(items, driver_for(session).finalize(session, writes)):
        if moved:
            out.append((wrote, None))
            continue
        current = current_row(session, item.claim.operation_id)
        if current is None:
            out.append((wrote, OperationNotFound(item.claim.operation_id)))
            continue
        detail = f"now {current.status} with token {current.fencing_token}"
        out.append((wrote, StaleFence(item.claim.operation_id, item.claim.fencing_token, detail)))
    return out


def _finalize_write(item: Finalize) -> FinalizeWrite:
    claim, report, to = item.claim, item.report, item.to
    # Nothing was sent (a breaker wait, an approval that no longer covers the send): not counted.
    refund = item.refund_attempt and to in (Status.NOT_DISPATCHED, Status.AWAITING_APPROVAL)
    waiting = waiting_on_entry(to, item.waiting_for)
    return FinalizeWrite(
        to,
        refund,
        to in NO_EFFECT,
        {
            "reason": item.reason,
            "event_reason": report.event_reason(f"attempt {claim.attempt_number}", item.reason),
            "event": EventKind.ATTEMPT_RESULT.value,
            "actor": claim.worker,
            "operation_id": claim.operation_id,
            "token": claim.fencing_token,
            "attempt_id": claim.attempt_id,
            "waiting_for": waiting.value if waiting else None,
            "delay_s": float(max(item.delay_s, 0.0)),
            "result": item.result,
            **report_params(report),
            **_record(report, to),
        },
    )


def _record(report: AttemptReport, to: Status) -> dict[str, Any]:
    """The request to record if none is on record (writes.RECORD_FIRST)."""
    return NO_RECORD if report.sent is None else _recorded(report.sent, to).params()


def _recorded(sent: RequestRecord, to: Status) -> RequestRecord:
    """``sent`` as recorded: its body kept only while another attempt may follow (after a success
    nothing is sent under the key again)."""
    return replace(sent, body=None) if to in EFFECT else sent


def report_params(report: AttemptReport) -> dict[str, Any]:
    return {
        "klass": report.klass.value,
        "status_code": report.status_code,
        "request_digest": report.request_digest,
        "provider_request_id": report.provider_request_id,
        "provider_reference": report.provider_reference,
        "response_digest": report.response_digest,
        "retry_after_s": report.retry_after_s,
        "latency_s": report.latency_s,
        "error": report.error,
        **NO_RECORD,  # a settlement's (and the attempt row's) parameters: it records no request
    }


def current_row(session: Any, operation_id: str) -> Any:
    """(status, fencing_token) of the operation now, or None."""
    return driver_for(session).current_row(session, operation_id)


def _still_ours(session: Any, claim: Claim) -> bool:
    row = current_row(session, claim.operation_id)
    return row is not None and row.status == Status.DISPATCHING.value and row.fencing_token == claim.fencing_token


T = TypeVar("T")


def commit_even_if_stale(sessions: sessionmaker[Session], write: Callable[[Session], T]) -> T:
    """Run ``write`` in one transaction; if it raises StaleFence, commit anyway, then re-raise.

    A refused (stale) worker's attempt row already holds its result inside that transaction:
    committing keeps that evidence while the refusal still reaches the caller.
    """
    stale: StaleFence | None = None
    with sessions.begin() as session:
        try:
            return write(session)
        except StaleFence as exc:
            stale = exc
    raise stale


def mark_attempt_stale(session: Any, attempt_id: int) -> None:
    """The attempt's result arrived after its worker lost the operation: evidence, not a verdict."""
    driver_for(session).mark_attempt_stale(session, attempt_id)


_CANCEL_LATER = {
    Status.DISPATCHING: "a request is in flight: nothing more is sent, a late success is still recorded",
    Status.OUTCOME_UNKNOWN: "an earlier attempt may have landed: the reconciler settles it, nothing more is sent",
    Status.NOT_DISPATCHED: "an earlier attempt may still land: looked up first, nothing more is sent",
    Status.AWAITING_APPROVAL: "an earlier attempt may still land: looked up first, nothing more is sent",
    Status.RECONCILIATION_REQUIRED: "a person decides; nothing more is sent",
}


def request_cancel(session: Session, operation_id: str, *, actor: str, reason: str = "cancel requested") -> Status:
    """Cancel before anything was sent; otherwise only keep the flag.

    A request already in flight cannot be called back: a late success is recorded as success
    ("completed after cancel requested"), never dropped. The same holds for an operation waiting
    for its next attempt while an earlier one may still land (effect_guard.py): it keeps the flag,
    nothing more is sent, and the reconciler settles what the earlier attempt did.
    """
    try:
        move(
            session,
            operation_id,
            sources=[Status.NOT_DISPATCHED, Status.AWAITING_APPROVAL],
            to=Status.CANCELLED,
            event=EventKind.CANCEL,
            actor=actor,
            reason=reason,
            extra_where=[no_effect_possible()],
            cancel_requested=True,
        )
        return Status.CANCELLED
    except IllegalTransition:
        row = session.execute(
            update(_OP)
            .where(_OP.c.id == operation_id)
            .values(cancel_requested=True, updated_at=db_now())
            .returning(_OP.c.status, _OP.c.fencing_token)
        ).first()
        if row is None:
            raise OperationNotFound(operation_id) from None
        status = Status(row.status)
        # The history says who asked, when and why, whether or not it could take effect yet.
        record_events(
            session,
            [(operation_id, row.fencing_token)],
            from_status=status,
            to=status,
            kind=EventKind.CANCEL_REQUESTED,
            reason=f"{reason}; {_CANCEL_LATER.get(status, 'it cannot take effect: the operation has ended')}",
            actor=actor,
        )
        return status


def approve(session: Session, operation_id: str, *, actor: str, reason: str = "approved") -> None:
    move(
        session,
        operation_id,
        sources=[Status.AWAITING_APPROVAL],
        to=Status.NOT_DISPATCHED,
        event=EventKind.APPROVE,
        actor=actor,
        reason=reason,
        next_attempt_at=db_now(),
    )
