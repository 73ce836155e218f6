"""Every transition of the state machine as one guarded UPDATE plus the row that records why.

Worker-side transitions are fenced: ``WHERE id = ? AND status = ? AND fencing_token = ?``. A worker
whose token is stale matches no row and gets ``StaleFence``; its attempt's evidence is still kept
(``finalize_if_fenced`` writes the attempt row first and marks it stale). The caller owns the
transaction: catch ``StaleFence`` inside ``with session.begin():`` to commit that evidence.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from psycopg.rows import namedtuple_row
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.claims import Claim
from outbox.clock import db_now
from outbox.db import driver_connection, driver_sql, is_postgres
from outbox.effect_guard import NO_EFFECT_POSSIBLE, no_effect_possible
from outbox.errors import IllegalTransition, OperationNotFound, OutboxError, StaleFence
from outbox.models import Attempt, Operation, OperationEvent, core_table
from outbox.states import ALLOWED, NO_EFFECT, PROVABLY_NOT_EXECUTED, TERMINAL, AttemptClass, Status

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


def _check_allowed(operation_id: str, sources: Iterable[Status], to: Status) -> None:
    for src in sources:
        if (src, to) not in ALLOWED:
            raise IllegalTransition(operation_id, src.value, to.value)


def _event(
    session: Session,
    operation_id: str,
    *,
    from_status: str | None,
    to: Status,
    token: int,
    event: str,
    reason: str | None,
    actor: str,
) -> None:
    session.execute(
        insert(OperationEvent).values(
            operation_id=operation_id,
            at=db_now(),
            from_status=from_status,
            to_status=to.value,
            fencing_token=token,
            event=event,
            reason=reason,
            actor=actor,
        )
    )


def move(
    session: Session,
    operation_id: str,
    *,
    sources: Iterable[Status],
    to: Status,
    event: str,
    actor: str,
    reason: str | None = None,
    token: int | None = None,
    extra_where: Iterable[Any] = (),
    **values: Any,
) -> tuple[str | None, int]:
    """Move one operation from one of ``sources`` to ``to`` if the guards hold.

    Returns (previous status, token). Raises ``StaleFence`` when a token was given and the row does
    not match it (or its status moved on), ``IllegalTransition``/``OperationNotFound`` otherwise.
    """
    srcs = list(sources)
    _check_allowed(operation_id, srcs, to)
    conds = [_OP.c.id == operation_id, _OP.c.status.in_([s.value for s in srcs]), *extra_where]
    if token is not None:
        conds.append(_OP.c.fencing_token == token)
    values.setdefault("updated_at", db_now())
    values.setdefault("reason", reason or event)
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
    _event(
        session,
        operation_id,
        from_status=previous,
        to=to,
        token=row.fencing_token,
        event=event,
        reason=reason,
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
        .values(
            ended_at=db_now(),
            attempt_class=report.klass.value,
            status_code=report.status_code,
            request_digest=report.request_digest,
            provider_request_id=report.provider_request_id,
            provider_reference=report.provider_reference,
            response_digest=report.response_digest,
            retry_after_s=report.retry_after_s,
            latency_s=report.latency_s,
            error=report.error,
            stale=stale,
        )
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
) -> None:
    """Record the attempt, then move the claimed operation to ``to`` under its token.

    ``to`` is one of: succeeded, committed_evidence_degraded (2xx), not_dispatched (retry after
    ``delay_s``; ``refund_attempt`` when nothing was sent, e.g. breaker open), failed_before_commit
    or cancelled (only with a provably-not-executed class, and only while no other attempt may
    have taken effect: effect_guard.py), outcome_unknown (ambiguous).
    Raises StaleFence (the attempt row still holds the result, marked stale) or IllegalTransition.
    """
    (refused,) = finalize_many_if_fenced(
        session, [Finalize(claim, report, to, reason, delay_s, refund_attempt, result)]
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
            _check_allowed(item.claim.operation_id, [Status.DISPATCHING], item.to)
        except IllegalTransition as exc:
            refusals[i] = exc
            continue
        if item.to in NO_EFFECT and item.report.klass not in PROVABLY_NOT_EXECUTED:
            refusals[i] = IllegalTransition(
                item.claim.operation_id, "dispatching/" + item.report.klass.value, item.to.value
            )
        else:
            ready.append(i)
    if is_postgres(session):
        outcomes = _finalize_pg(session, [items[i] for i in ready])
    else:
        outcomes = [_finalize_portable(session, items[i]) for i in ready]
    for i, (wrote, refused) in zip(ready, outcomes):
        if refused is None:
            continue
        item = items[i]
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


def _event_of(item: Finalize) -> str:
    return f"attempt {item.claim.attempt_number}: {item.report.klass.value}"


def _finalize_portable(session: Session, item: Finalize) -> tuple[bool, OutboxError | None]:
    """SQLite: the attempt row, then the guarded move (with its event row)."""
    claim, report, to = item.claim, item.report, item.to
    values: dict[str, Any] = dict(lease_owner=None, lease_expires_at=None)
    extra_where: list[Any] = []
    if to in (Status.SUCCEEDED, Status.COMMITTED_EVIDENCE_DEGRADED):
        values.update(
            result_reference=report.provider_reference,
            result_digest=report.response_digest,
            result=item.result,
            error_class=None,
        )
    else:
        values.update(error_class=report.klass.value, last_error=report.error)
    if to in (Status.NOT_DISPATCHED, Status.OUTCOME_UNKNOWN):
        values["next_attempt_at"] = db_now(max(item.delay_s, 0.0))
        if to is Status.NOT_DISPATCHED and item.refund_attempt:
            values["attempt_count"] = _OP.c.attempt_count - 1
    elif to in NO_EFFECT:
        # The ledger itself refuses "no effect" while an earlier attempt may have taken effect.
        extra_where.append(no_effect_possible(excluding_attempt=claim.attempt_id))
    wrote = record_attempt(session, claim.attempt_id, report)
    try:
        move(
            session,
            claim.operation_id,
            sources=[Status.DISPATCHING],
            to=to,
            event=_event_of(item),
            actor=claim.worker,
            reason=item.reason,
            token=claim.fencing_token,
            extra_where=extra_where,
            **values,
        )
    except StaleFence as exc:
        return wrote, exc
    return wrote, None


def _finalize_pg(session: Session, items: Sequence[Finalize]) -> list[tuple[bool, OutboxError | None]]:
    """PostgreSQL: one statement per item (attempt row, fenced move, event row), all pipelined."""
    if not items:
        return []
    conn = driver_connection(session)
    cursors = []
    with conn.pipeline():
        for item in items:
            claim, report = item.claim, item.report
            cursor = conn.cursor(row_factory=namedtuple_row)
            refund = item.refund_attempt and item.to is Status.NOT_DISPATCHED
            cursor.execute(
                _finalize_sql(item.to, refund, item.to in NO_EFFECT),
                {
                    "to": item.to.value,
                    "reason": item.reason,
                    "event": _event_of(item),
                    "actor": claim.worker,
                    "operation_id": claim.operation_id,
                    "token": claim.fencing_token,
                    "attempt_id": claim.attempt_id,
                    "klass": report.klass.value,
                    "status_code": report.status_code,
                    "request_digest": report.request_digest,
                    "provider_request_id": report.provider_request_id,
                    "provider_reference": report.provider_reference,
                    "response_digest": report.response_digest,
                    "retry_after_s": report.retry_after_s,
                    "latency_s": report.latency_s,
                    "error": report.error,
                    "result": json.dumps(item.result) if item.result is not None else None,
                    "delay_s": float(max(item.delay_s, 0.0)),
                },
            )
            cursors.append(cursor)
    out: list[tuple[bool, OutboxError | None]] = []
    for item, cursor in zip(items, cursors):
        row = cursor.fetchone()
        if row.moved:
            out.append((bool(row.wrote), None))
            continue
        current = current_row(session, item.claim.operation_id)
        if current is None:
            out.append((bool(row.wrote), OperationNotFound(item.claim.operation_id)))
            continue
        out.append(
            (
                bool(row.wrote),
                StaleFence(
                    item.claim.operation_id,
                    item.claim.fencing_token,
                    f"now {current.status} with token {current.fencing_token}",
                ),
            )
        )
    return out


@functools.lru_cache(maxsize=32)
def _finalize_sql(to: Status, refund: bool, guard: bool) -> Any:
    """The one-statement finalize for PostgreSQL, as SQL text built once per shape.

    Text sent through the driver, not a Core construct: building the construct, and even
    SQLAlchemy's per-execute result processing for text(), cost more client CPU per call than the
    database spent executing it (bench/README.md). It writes exactly what the portable path does.
    """
    sets = [
        "status = :to",
        "updated_at = clock_timestamp()",
        "reason = :reason",
        "lease_owner = NULL",
        "lease_expires_at = NULL",
    ]
    if to in (Status.SUCCEEDED, Status.COMMITTED_EVIDENCE_DEGRADED):
        sets += [
            "result_reference = :provider_reference",
            "result_digest = :response_digest",
            "result = CAST(:result AS json)",
            "error_class = NULL",
        ]
    else:
        sets += ["error_class = :klass", "last_error = :error"]
    if to in (Status.NOT_DISPATCHED, Status.OUTCOME_UNKNOWN):
        sets.append("next_attempt_at = clock_timestamp() + make_interval(secs => :delay_s)")
    if refund:
        sets.append("attempt_count = attempt_count - 1")
    if to in TERMINAL:
        sets.append("finished_at = clock_timestamp()")
    where = "id = :operation_id AND status = 'dispatching' AND fencing_token = :token"
    if guard:
        where += " AND " + NO_EFFECT_POSSIBLE
    return driver_sql(f"""
WITH att AS (
    UPDATE attempts SET ended_at = clock_timestamp(), attempt_class = :klass, status_code = :status_code,
        request_digest = :request_digest, provider_request_id = :provider_request_id,
        provider_reference = :provider_reference, response_digest = :response_digest,
        retry_after_s = :retry_after_s, latency_s = :latency_s, error = :error, stale = false
    WHERE id = :attempt_id AND ended_at IS NULL
    RETURNING id
), moved AS (
    UPDATE operations SET {", ".join(sets)}
    WHERE {where}
    RETURNING id, fencing_token
), logged AS (
    INSERT INTO operation_events (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT id, clock_timestamp(), 'dispatching', :to, fencing_token, :event, :reason, :actor FROM moved
    RETURNING id
)
SELECT (SELECT count(*) FROM att) AS wrote, (SELECT count(*) FROM moved) AS moved,
       (SELECT count(*) FROM logged) AS logged
""")


def current_row(session: Any, operation_id: str) -> Any:
    """(status, fencing_token) of the operation now, or None."""
    if is_postgres(session):
        return (
            driver_connection(session)
            .cursor(row_factory=namedtuple_row)
            .execute("SELECT status, fencing_token FROM operations WHERE id = %(id)s", {"id": operation_id})
            .fetchone()
        )
    return session.execute(select(_OP.c.status, _OP.c.fencing_token).where(_OP.c.id == operation_id)).first()


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
    if is_postgres(session):
        driver_connection(session).execute("UPDATE attempts SET stale = true WHERE id = %(id)s", {"id": attempt_id})
        return
    session.execute(update(_AT).where(_AT.c.id == attempt_id).values(stale=True))


def expire_leases(session: Session, *, limit: int = 500, actor: str = "sweep") -> list[str]:
    """dispatching operations whose lease ran out -> outcome_unknown (never back to not_dispatched).

    A crashed or frozen worker may have sent the request; only a lookup can tell.
    """
    rows = session.execute(
        select(_OP.c.id, _OP.c.fencing_token)
        .where(_OP.c.status == Status.DISPATCHING.value, _OP.c.lease_expires_at < db_now())
        .order_by(_OP.c.lease_expires_at)
        .limit(limit)
    ).all()
    moved = []
    for row in rows:
        try:
            move(
                session,
                row.id,
                sources=[Status.DISPATCHING],
                to=Status.OUTCOME_UNKNOWN,
                event="lease expired",
                actor=actor,
                reason="lease expired: the worker may have sent the request",
                token=row.fencing_token,
                extra_where=[_OP.c.lease_expires_at < db_now()],
                lease_owner=None,
                lease_expires_at=None,
                error_class=AttemptClass.AMBIGUOUS.value,
                last_error="lease expired before the worker reported a result",
                next_attempt_at=db_now(),
            )
        except StaleFence:
            continue  # the owner finished (or renewed) between our read and our write
        moved.append(row.id)
    return moved


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
            event="cancel",
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
            .returning(_OP.c.status)
        ).first()
        if row is None:
            raise OperationNotFound(operation_id) from None
        return Status(row.status)


def approve(session: Session, operation_id: str, *, actor: str, reason: str = "approved") -> None:
    move(
        session,
        operation_id,
        sources=[Status.AWAITING_APPROVAL],
        to=Status.NOT_DISPATCHED,
        event="approve",
        actor=actor,
        reason=reason,
        next_attempt_at=db_now(),
    )
