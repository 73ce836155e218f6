"""Claims: a worker takes a due operation under a lease and a fresh fencing token.

One statement per claim. On PostgreSQL the candidate rows are locked with ``FOR UPDATE SKIP
LOCKED`` in a CTE so that concurrent workers never wait for each other; on SQLite (one writer at a
time) a guarded UPDATE over a sub-select does the same. In both, the claim bumps the token, sets
``dispatching`` with a lease from the database clock, counts the attempt and inserts the attempt
row, all in the caller's transaction. The previous owner's token now matches no row.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.rows import namedtuple_row
from sqlalchemy import Row, func, insert, or_, select, text, update
from sqlalchemy.orm import Session

from outbox.clock import LedgerClock, as_utc, db_now
from outbox.db import driver_connection, driver_sql, is_postgres
from outbox.effect_guard import may_have_taken_effect
from outbox.models import Attempt, Operation, OperationEvent, core_table
from outbox.states import AttemptClass, Status

_OP = core_table(Operation)


@dataclass(frozen=True)
class Claim:
    """What a worker holds while its lease lasts: enough to call the downstream and finalize."""

    operation_id: str
    fencing_token: int
    attempt_id: int
    attempt_number: int  # row sequence of this kind: dispatch attempt n, or lookup n
    kind: str  # "dispatch" (a worker will send the request) or "lookup" (the reconciler asks)
    tenant: str
    idempotency_key: str
    action: str
    args: str  # canonical JSON text
    args_digest: str
    subject: str
    worker: str
    lease_expires_at: dt.datetime
    max_attempts: int | None  # None: the action's budget decides
    attempt_count: int  # budget-counted dispatch attempts so far, this one included (refunds excluded)
    deadline_at: dt.datetime | None
    created_at: dt.datetime
    cancel_requested: bool
    # An earlier attempt may have taken effect (ambiguous or never reported, and not proven unable
    # to land), or did (a confirmed success on record, even a stale worker's): this operation must
    # not end failed_before_commit or cancelled (effect_guard.py).
    open_ambiguity: bool
    # Dispatch attempts up to this number were proven unable to take effect (a fenced lookup, the
    # provider's record, a person): before failing on budget, the reconciler looks once more.
    proven_absent_through: int = 0
    # The database's clock as of the claim: deadlines and windows are judged on it, never on this
    # worker's wall clock. None only for claims built by hand (tests): then the wall clock.
    clock: LedgerClock | None = None

    def now(self) -> dt.datetime:
        """The database's time now (as of the claim, plus the monotonic time since)."""
        return self.clock.now() if self.clock is not None else dt.datetime.now(dt.UTC)


_RETURNED = (
    _OP.c.id,
    _OP.c.fencing_token,
    _OP.c.attempt_count,
    _OP.c.tenant,
    _OP.c.idempotency_key,
    _OP.c.action,
    _OP.c.args,
    _OP.c.args_digest,
    _OP.c.subject,
    _OP.c.lease_expires_at,
    _OP.c.max_attempts,
    _OP.c.deadline_at,
    _OP.c.created_at,
    _OP.c.cancel_requested,
    _OP.c.proven_absent_through,
    _OP.c.updated_at,  # the claim's own time (the database's clock)
)


def claim_due(
    session: Session,
    *,
    worker: str,
    lease_s: float,
    limit: int = 1,
    operation_id: str | None = None,
    operation_ids: Sequence[str] | None = None,
    also_due: int = 0,
) -> list[Claim]:
    """Claim up to ``limit`` due ``not_dispatched`` operations (only ``operation_id(s)`` if given).

    ``also_due``: with ids given, also claim up to this many other due operations, oldest first,
    in the same statement (a doorbell's batch filled with whatever else is due).
    Returns the claims made, the given ids first; an empty list when nothing was due (another
    worker won, the operation is not due yet, or it is no longer ``not_dispatched``).
    """
    ids = _ids(operation_id, operation_ids)
    if also_due < 0:
        raise ValueError("also_due must be >= 0")
    return _claim(
        session,
        "dispatch",
        worker=worker,
        lease_s=lease_s,
        limit=limit,
        operation_ids=ids,
        also_due=also_due if ids is not None else 0,
    )


def _ids(operation_id: str | None, operation_ids: Sequence[str] | None) -> list[str] | None:
    if operation_id is not None and operation_ids is not None:
        raise ValueError("pass operation_id or operation_ids, not both")
    if operation_id is not None:
        return [operation_id]
    return list(operation_ids) if operation_ids is not None else None


def claim_unknown(
    session: Session,
    *,
    worker: str,
    lease_s: float,
    limit: int = 1,
    operation_id: str | None = None,
) -> list[Claim]:
    """The reconciler's claim: a due ``outcome_unknown`` operation whose lease (if any) has expired.

    The status stays ``outcome_unknown`` (nothing is re-sent); the token is bumped, a lease is taken
    and a ``lookup`` attempt row is opened for what the provider will say.
    """
    return _claim(
        session, "lookup", worker=worker, lease_s=lease_s, limit=limit, operation_ids=_ids(operation_id, None)
    )


def _claim(
    session: Session,
    kind: str,
    *,
    worker: str,
    lease_s: float,
    limit: int,
    operation_ids: list[str] | None,
    also_due: int = 0,
) -> list[Claim]:
    if limit < 1:
        raise ValueError("limit must be >= 1")
    pg = is_postgres(session)
    if pg:
        return _claim_pg(
            session, kind, worker=worker, lease_s=lease_s, limit=limit, operation_ids=operation_ids, also_due=also_due
        )
    claims = _claim_portable(session, kind, worker=worker, lease_s=lease_s, limit=limit, operation_ids=operation_ids)
    if also_due:
        # SQLite: one writer at a time (BEGIN IMMEDIATE), so a second statement sees the first.
        claims += _claim_portable(session, kind, worker=worker, lease_s=lease_s, limit=also_due, operation_ids=None)
    return claims


def _claim_portable(
    session: Session, kind: str, *, worker: str, lease_s: float, limit: int, operation_ids: list[str] | None
) -> list[Claim]:
    """SQLite (one writer at a time, BEGIN IMMEDIATE): a guarded UPDATE, then the attempt rows."""
    source = Status.NOT_DISPATCHED if kind == "dispatch" else Status.OUTCOME_UNKNOWN
    guard = [_OP.c.status == source.value, _OP.c.next_attempt_at <= db_now()]
    if kind == "lookup":
        guard.append(or_(_OP.c.lease_expires_at.is_(None), _OP.c.lease_expires_at < db_now()))
    due = select(_OP.c.id).where(*guard)
    if operation_ids is not None:
        due = due.where(_OP.c.id.in_(operation_ids))
    due = due.order_by(_OP.c.next_attempt_at).limit(limit)
    values: dict[str, Any] = dict(
        fencing_token=_OP.c.fencing_token + 1,
        lease_owner=worker,
        lease_expires_at=db_now(lease_s),
        updated_at=db_now(),
    )
    if kind == "dispatch":
        values.update(status=Status.DISPATCHING.value, attempt_count=_OP.c.attempt_count + 1, reason="claimed")
    # Re-check the guard in the UPDATE itself.
    stmt = update(_OP).values(**values).where(_OP.c.id.in_(due.scalar_subquery()), *guard)
    rows = session.execute(stmt.returning(*_RETURNED)).all()
    return [_record_claim(session, row, worker, kind) for row in rows]


# PostgreSQL: the whole claim in ONE statement (one round trip): lock due rows with SKIP LOCKED,
# bump token and lease, number the attempt, open the attempt row and the event row. The CTEs
# read attempts as of the statement's snapshot, so numbering and the ambiguity check see the
# rows committed before this claim (the inserts of this statement are not visible to them).
#
# One text per shape (kind, with or without ids, limits), with the status, kind and limits
# written in as literals: psycopg prepares a statement after a few executions, and only then can
# PostgreSQL keep one generic plan for it instead of planning it again on every call. With the
# status as a parameter the generic plan cannot use the partial index ``ix_operations_due``, and
# with LIMIT as a parameter it is costed for 10% of the table, so PostgreSQL re-planned every
# claim: planning cost as much as running it (bench/README.md).
_PG_CLAIM = """
WITH {due_ctes}, claimed AS (
    UPDATE operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = :worker,
        lease_expires_at = clock_timestamp() + make_interval(secs => :lease_s),
        updated_at = clock_timestamp(){dispatch_sets}
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.action, o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM attempts a
          WHERE a.operation_id = c.id AND a.kind = '{kind}') AS number,
        EXISTS (SELECT 1 FROM attempts a WHERE a.operation_id = c.id AND {may_have_taken_effect}) AS open_ambiguity
    FROM claimed c
), opened AS (
    INSERT INTO attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale)
    SELECT id, number, '{kind}', fencing_token, :worker, clock_timestamp(), 'pending', false FROM numbered
    RETURNING id AS attempt_id, operation_id
), logged AS (
    INSERT INTO operation_events (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT id, clock_timestamp(), '{source}', '{target}', fencing_token, '{event}', '{kind} attempt ' || number, :worker
    FROM numbered
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank
"""

# Due rows of one kind, oldest first; {ids} narrows or excludes, {limit} is a literal.
_PG_DUE = """
    SELECT id, {rank} AS rank FROM operations
    WHERE status = '{source}' AND next_attempt_at <= clock_timestamp(){lease_free}{ids}
    ORDER BY next_attempt_at
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED"""


@functools.lru_cache(maxsize=64)
def _pg_claim_sql(kind: str, with_ids: bool, limit: int, others: int) -> str:
    """The claim statement for one shape: ``limit`` of the given ids first, then ``others`` due rows."""
    if kind not in ("dispatch", "lookup"):  # written into the SQL text
        raise ValueError(f"unknown claim kind {kind!r}")
    lookup = kind == "lookup"
    source = Status.OUTCOME_UNKNOWN.value if lookup else Status.NOT_DISPATCHED.value
    due = functools.partial(
        _PG_DUE.format,
        source=source,
        lease_free=" AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())" if lookup else "",
    )
    if not with_ids:
        ctes = f"due AS ({due(rank=1, ids='', limit=int(limit))}\n)"
    else:
        ctes = f"wanted AS ({due(rank=0, ids=' AND id = ANY(CAST(:operation_ids AS varchar[]))', limit=int(limit))}\n)"
        if others:
            ctes += (
                f", others AS ({due(rank=1, ids=' AND NOT (id = ANY(CAST(:operation_ids AS varchar[])))', limit=int(others))}\n)"
                ", due AS (SELECT id, rank FROM wanted UNION ALL SELECT id, rank FROM others)"
            )
        else:
            ctes += ", due AS (SELECT id, rank FROM wanted)"
    return driver_sql(
        _PG_CLAIM.format(
            due_ctes=ctes,
            kind=kind,
            source=source,
            target=Status.OUTCOME_UNKNOWN.value if lookup else Status.DISPATCHING.value,
            event="reconcile claim" if lookup else "claim",
            may_have_taken_effect=may_have_taken_effect("c"),
            dispatch_sets=""
            if lookup
            else (",\n        status = 'dispatching', attempt_count = o.attempt_count + 1, reason = 'claimed'"),
        )
    )


def _claim_pg(
    session: Session,
    kind: str,
    *,
    worker: str,
    lease_s: float,
    limit: int,
    operation_ids: list[str] | None,
    also_due: int,
) -> list[Claim]:
    # Sent through the driver (psycopg's %(name)s parameters), not through SQLAlchemy's text():
    # its per-execute result processing cost more client CPU than the claim cost PostgreSQL.
    sql = _pg_claim_sql(kind, operation_ids is not None, limit, also_due)
    cursor = driver_connection(session).cursor(row_factory=namedtuple_row)
    rows = cursor.execute(sql, {"operation_ids": operation_ids, "worker": worker, "lease_s": float(lease_s)}).fetchall()
    return [_claim_of(row, worker, kind, row.attempt_id, row.number, row.open_ambiguity) for row in rows]


def _record_claim(session: Session, row: Row[Any], worker: str, kind: str) -> Claim:
    open_ambiguity = session.execute(
        text(
            f"SELECT EXISTS (SELECT 1 FROM attempts a WHERE a.operation_id = o.id AND {may_have_taken_effect('o')})"
            " FROM operations o WHERE o.id = :id"
        ),
        {"id": row.id},
    ).scalar_one()
    # Attempt rows are numbered in sequence per kind. Not attempt_count: a breaker-open wait
    # refunds its attempt to the budget, but its row (evidence) keeps its number.
    number = (
        1
        + session.execute(
            select(func.coalesce(func.max(Attempt.attempt_number), 0)).where(
                Attempt.operation_id == row.id, Attempt.kind == kind
            )
        ).scalar_one()
    )
    attempt_id = session.execute(
        insert(Attempt)
        .values(
            operation_id=row.id,
            attempt_number=number,
            kind=kind,
            fencing_token=row.fencing_token,
            worker=worker,
            started_at=db_now(),
            attempt_class=AttemptClass.PENDING.value,
        )
        .returning(Attempt.id)
    ).scalar_one()
    status = Status.DISPATCHING if kind == "dispatch" else Status.OUTCOME_UNKNOWN
    session.execute(
        insert(OperationEvent).values(
            operation_id=row.id,
            at=db_now(),
            from_status=Status.NOT_DISPATCHED.value if kind == "dispatch" else status.value,
            to_status=status.value,
            fencing_token=row.fencing_token,
            event="claim" if kind == "dispatch" else "reconcile claim",
            reason=f"{kind} attempt {number}",
            actor=worker,
        )
    )
    return _claim_of(row, worker, kind, attempt_id, number, bool(open_ambiguity))


def _claim_of(row: Row[Any], worker: str, kind: str, attempt_id: int, number: int, open_ambiguity: bool) -> Claim:
    lease = as_utc(row.lease_expires_at)
    created = as_utc(row.created_at)
    claimed = as_utc(row.updated_at)
    assert lease is not None and created is not None and claimed is not None
    return Claim(
        operation_id=row.id,
        fencing_token=row.fencing_token,
        attempt_id=attempt_id,
        attempt_number=number,
        kind=kind,
        tenant=row.tenant,
        idempotency_key=row.idempotency_key,
        action=row.action,
        args=row.args or "{}",
        args_digest=row.args_digest,
        subject=row.subject,
        worker=worker,
        lease_expires_at=lease,
        max_attempts=row.max_attempts,
        attempt_count=row.attempt_count,
        deadline_at=as_utc(row.deadline_at),
        created_at=created,
        cancel_requested=bool(row.cancel_requested),
        open_ambiguity=bool(open_ambiguity),
        proven_absent_through=int(row.proven_absent_through or 0),
        clock=LedgerClock(claimed),
    )


def extend_lease_if_fenced(session: Session, claim: Claim, *, lease_s: float) -> bool:
    """Renew the lease of a live claim; False when the token is no longer current."""
    stmt = (
        update(_OP)
        .where(
            _OP.c.id == claim.operation_id,
            _OP.c.status == (Status.DISPATCHING.value if claim.kind == "dispatch" else Status.OUTCOME_UNKNOWN.value),
            _OP.c.fencing_token == claim.fencing_token,
        )
        .values(lease_expires_at=db_now(lease_s), updated_at=db_now())
        .returning(_OP.c.id)
    )
    return session.execute(stmt).first() is not None
