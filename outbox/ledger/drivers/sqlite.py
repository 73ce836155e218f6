"""The SQLite ledger driver (the embedded default): SQLAlchemy Core, one writer at a time.

Several processes share one file safely (outbox/ledger/drivers/sqlite_engine.py: WAL, a busy
timeout, ``BEGIN IMMEDIATE`` for every transaction). With one writer at a time, a claim is a guarded
UPDATE over a sub-select followed by its attempt and event rows (the same transaction sees them).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, func, insert, or_, select, text, true, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.clock import db_age_s, db_now
from outbox.ledger.drivers import sqlite_engine
from outbox.ledger.drivers.base import ClaimedRow, FinalizeWrite, Inserted, NewOperation, StaleRules
from outbox.ledger.drivers.sqlite_ranking import fair_order
from outbox.ledger.effect_guard import may_have_taken_effect, no_effect_possible
from outbox.ledger.events import record_events
from outbox.ledger.fairness import Fairness
from outbox.ledger.models import ATTEMPTS, OPERATIONS, Attempt, Evidence, Operation, Run, core_table
from outbox.ledger.request_record import RECORD_IF_NONE, left_versions_sql
from outbox.ledger.states import RECONCILE_CLAIMABLE, AttemptClass, AttemptKind, EventKind, Status
from outbox.ledger.writes import ATTEMPT_REPORT, core_values

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

_OP = core_table(Operation)
_AT = core_table(Attempt)

# NewOperation fields written as they are.
_AS_GIVEN: tuple[str, ...] = ("id", "tenant", "idempotency_key", "provider_key", "action", "args", "args_digest")
_AS_GIVEN += ("subject", "run_id", "tool_call_id", "submitted_by", "key_space", "priority", "traceparent")
_AS_GIVEN += ("object_key", "budget_scope", "action_version")

# A claimed row's columns, in ClaimedRow's order (the attempt's own fields are added by _open_attempt).
_NOT_COLUMNS = ("attempt_id", "number", "open_ambiguity", "left_versions")
_V = Mapping[str, str] | None  # a worker's versions of the actions (claim)
_CLAIMED = tuple(_OP.c[name] for name in ClaimedRow._fields if name not in _NOT_COLUMNS)


class SqliteDriver:
    name = "sqlite"

    def make_engine(self, url: str, **kwargs: Any) -> Engine:
        return sqlite_engine.make_engine(url, **kwargs)

    def make_async_engine(self, url: str, **kwargs: Any) -> AsyncEngine:
        return sqlite_engine.make_async_engine(url, **kwargs)

    def lock_for_migration(self, conn: Connection) -> None:
        """BEGIN IMMEDIATE already holds the one write lock."""

    @contextmanager
    def migrating(self, conn: Connection) -> Iterator[None]:
        """Foreign keys off (a rebuilt table's DROP would cascade), set outside the transaction."""
        raw: Any = conn.connection.dbapi_connection
        raw.execute("PRAGMA foreign_keys=OFF")
        try:
            yield
            if dangling := raw.execute("PRAGMA foreign_key_check").fetchall():
                raise RuntimeError(f"migration left rows without their parent: {dangling[:5]}")
        finally:
            raw.execute("PRAGMA foreign_keys=ON")

    def notify_due(self, session: Session, operation_id: str) -> None:
        """No NOTIFY: the relay polls."""

    def set_statement_timeout(self, session: Session, ms: int) -> None:
        """SQLite has no statement timeout; the busy timeout bounds waiting for the lock."""

    def hot_path(self, engine: Engine, sessions: sessionmaker[Session]) -> SessionHotPath:
        return SessionHotPath(sessions)

    # -- writes of the state machine -------------------------------------------------------------
    def insert_operation(self, session: Session, new: NewOperation) -> Inserted | None:
        row = session.execute(
            sqlite_insert(_OP)
            .values(
                **{c: getattr(new, c) for c in _AS_GIVEN},
                status=new.status.value,
                waiting_for=new.waiting_for.value if new.waiting_for else None,
                reason="submitted",
                fencing_token=0,
                attempt_count=0,
                max_attempts=new.max_attempts,
                deadline_at=db_now(new.deadline_s) if new.deadline_s is not None else None,
                next_attempt_at=db_now(new.delay_s),
                cancel_requested=False,
                proven_absent_through=0,
                created_at=db_now(),
                updated_at=db_now(),
            )
            .on_conflict_do_nothing(index_elements=[_OP.c.tenant, _OP.c.idempotency_key])
            .returning(_OP.c.created_at, _OP.c.updated_at, _OP.c.next_attempt_at, _OP.c.deadline_at)
        ).first()
        if row is None:
            return None
        inserted = Inserted(*row)
        record_events(
            session,
            [(new.id, 0)],
            from_status=None,
            to=new.status,
            kind=EventKind.SUBMIT,
            reason=new.reason,
            actor=new.subject,
            at=inserted.created_at,
        )
        return inserted

    def claim(
        self,
        session: Session,
        kind: AttemptKind,
        *,
        worker: str,
        lease_s: float,
        limit: int,
        operation_ids: list[str] | None,
        also_due: int,
        fairness: Fairness | None = None,
        versions: Mapping[str, str] | None = None,
    ) -> list[ClaimedRow]:
        def take(limit: int, within: Any) -> list[ClaimedRow]:
            return self._claim(
                session, kind, worker=worker, lease_s=lease_s, limit=limit, within=within, versions=versions
            )

        if kind is AttemptKind.DISPATCH and fairness is not None and fairness.on and (not operation_ids or also_due):
            order = fair_order(session, operation_ids or [], limit + also_due if operation_ids else limit, fairness)
            rows = take(len(order), _OP.c.id.in_(order))
            return sorted(rows, key=lambda row: order.index(row.id))  # in rank order
        claimed = take(limit, true() if operation_ids is None else _OP.c.id.in_(operation_ids))
        if operation_ids is not None and also_due:
            # Then other due rows, never a given id; one writer at a time: this statement sees the first.
            claimed += take(also_due, _OP.c.id.not_in(operation_ids))
        return claimed

    def _claim(
        self, session: Session, kind: AttemptKind, *, worker: str, lease_s: float, limit: int, within: Any, versions: _V
    ) -> list[ClaimedRow]:
        lookup = kind is AttemptKind.LOOKUP
        # A lookup claim keeps its row's status (outcome_unknown or accepted).
        sources = sorted(RECONCILE_CLAIMABLE) if lookup else [Status.NOT_DISPATCHED]
        guard = [_OP.c.status.in_([s.value for s in sources]), _OP.c.next_attempt_at <= db_now()]
        if lookup:
            guard.append(or_(_OP.c.lease_expires_at.is_(None), _OP.c.lease_expires_at < db_now()))
        order = (_OP.c.next_attempt_at,) if lookup else (_OP.c.priority.desc(), _OP.c.next_attempt_at)
        due = select(_OP.c.id).where(*guard, within).order_by(*order).limit(limit)
        values: dict[str, Any] = dict(
            fencing_token=_OP.c.fencing_token + 1,
            lease_owner=worker,
            lease_expires_at=db_now(lease_s),
            updated_at=db_now(),
        )
        if not lookup:
            values.update(
                status=Status.DISPATCHING.value,
                attempt_count=_OP.c.attempt_count + 1,
                reason="claimed",
                waiting_for=None,
            )
        # One writer at a time: the rows read here are the rows the UPDATE finds (its guard checks again).
        chosen = list(session.execute(due).scalars())
        if not chosen:
            return []
        rank = {op_id: n for n, op_id in enumerate(chosen)}
        stmt = update(_OP).values(**values).where(_OP.c.id.in_(chosen), *guard)
        rows = sorted(session.execute(stmt.returning(*_CLAIMED)).all(), key=lambda row: rank[row.id])
        return [self._open_attempt(session, row, worker, kind, versions) for row in rows]

    def _open_attempt(self, session: Session, row: Any, worker: str, kind: AttemptKind, versions: _V) -> ClaimedRow:
        lookup = kind is AttemptKind.LOOKUP
        left = "NULL" if lookup else left_versions_sql("o", "group_concat(DISTINCT {})")
        open_ambiguity, left_versions = session.execute(
            text(
                f"SELECT EXISTS (SELECT 1 FROM {ATTEMPTS} a WHERE a.operation_id = o.id AND {may_have_taken_effect('o')}),"
                f" {left} FROM {OPERATIONS} o WHERE o.id = :id"
            ),
            {"id": row.id},
        ).one()
        # Attempt rows are numbered in sequence per kind. Not attempt_count: a breaker-open wait
        # refunds its attempt to the budget, but its row (evidence) keeps its number.
        number = (
            1
            + session.execute(
                select(func.coalesce(func.max(_AT.c.attempt_number), 0)).where(
                    _AT.c.operation_id == row.id, _AT.c.kind == kind.value
                )
            ).scalar_one()
        )
        attempt_id = session.execute(
            insert(_AT)
            .values(
                operation_id=row.id,
                attempt_number=number,
                kind=kind.value,
                fencing_token=row.fencing_token,
                worker=worker,
                started_at=db_now(),
                attempt_class=AttemptClass.PENDING.value,
                stale=False,
                action_version=None if lookup or versions is None else versions.get(row.action),
            )
            .returning(_AT.c.id)
        ).scalar_one()
        record_events(
            session,
            [(row.id, row.fencing_token)],
            from_status=Status(row.status) if lookup else Status.NOT_DISPATCHED,
            to=Status(row.status),
            kind=EventKind.RECONCILE_CLAIM if lookup else EventKind.CLAIM,
            reason=f"{kind.value} attempt {number}",
            actor=worker,
        )
        head, tail = tuple(row)[:18], tuple(row)[18:]  # tail: traceparent, the version, the record, submitted_by
        return ClaimedRow(*head, attempt_id, number, bool(open_ambiguity), *tail, left_versions=left_versions)  # type: ignore[call-arg,misc]

    def finalize(self, session: Session, writes: Sequence[FinalizeWrite]) -> list[tuple[bool, bool]]:
        return [self._finalize(session, w) for w in writes]

    def _finalize(self, session: Session, w: FinalizeWrite) -> tuple[bool, bool]:
        p = dict(w.params, to=w.to.value, stale=False)
        wrote = (
            session.execute(
                update(_AT)
                .where(_AT.c.id == p["attempt_id"], _AT.c.ended_at.is_(None))
                .values(**core_values(ATTEMPT_REPORT, p, _AT))
                .returning(_AT.c.id)
            ).first()
            is not None
        )
        where = [
            _OP.c.id == p["operation_id"],
            _OP.c.status == w.source.value,
            _OP.c.fencing_token == p["token"],
        ]
        if w.guard:
            where.append(no_effect_possible(excluding_attempt=p["attempt_id"]))
        moved = session.execute(
            update(_OP).where(*where).values(**core_values(w.write_set(), p, _OP)).returning(_OP.c.fencing_token)
        ).first()
        if moved is None:
            return wrote, False
        record_events(
            session,
            [(p["operation_id"], moved.fencing_token)],
            from_status=w.source,
            to=w.to,
            kind=p["event"],
            reason=p["event_reason"],
            actor=p["actor"],
        )
        return wrote, True

    def current_row(self, session: Session, operation_id: str) -> Any:
        return session.execute(select(_OP.c.status, _OP.c.fencing_token).where(_OP.c.id == operation_id)).first()

    def mark_attempt_stale(self, session: Session, attempt_id: int) -> None:
        session.execute(update(_AT).where(_AT.c.id == attempt_id).values(stale=True))

    def record_request(self, session: Session, operation_id: str, params: dict[str, Any]) -> bool:
        found = session.execute(text(RECORD_IF_NONE), {**params, "operation_id": operation_id}).first()
        return found is not None

    # -- reads of the hot path --------------------------------------------------------------------
    def read_due(self, session: Session, operation_ids: Sequence[str]) -> list[Any]:
        return list(
            session.execute(
                select(
                    _OP.c.id,
                    _OP.c.action,
                    _OP.c.created_at,
                    _OP.c.deadline_at,
                    _OP.c.max_attempts,
                    _OP.c.attempt_count,
                    db_now().label("db_now"),
                ).where(
                    _OP.c.id.in_(list(operation_ids)),
                    _OP.c.status == Status.NOT_DISPATCHED.value,
                    _OP.c.next_attempt_at <= db_now(),
                )
            ).all()
        )

    def attempt_log(self, session: Session, operation_ids: Sequence[str], columns: tuple[str, ...]) -> list[Any]:
        return list(
            session.execute(
                select(*[_AT.c[name] for name in columns])
                .where(_AT.c.operation_id.in_(list(operation_ids)))
                .order_by(_AT.c.id)
            ).all()
        )

    def insert_evidence(self, session: Session, records: Sequence[dict[str, Any]]) -> None:
        if records:  # an INSERT of no rows is an error here (PostgreSQL's executemany does nothing)
            session.execute(insert(core_table(Evidence)).values([dict(r, recorded_at=db_now()) for r in records]))

    def analyze_stale(
        self, conn: Any, tables: Sequence[str], rules: StaleRules, seen: dict[str, int] | None = None
    ) -> list[str]:
        # SQLite plans every statement on its own (no cached generic plans), from sqlite_stat1
        # that nothing here writes: without it the planner prefers the primary key for ids.
        rules.young = set()
        return []

    def upsert(self, table: Any) -> Any:
        return sqlite_insert(table)

    def insert_run(self, session: Session, values: dict[str, Any]) -> bool:
        stmt = self.upsert(core_table(Run)).values(values).on_conflict_do_nothing(index_elements=["tenant", "run_key"])
        return session.execute(stmt.returning(core_table(Run).c.id)).first() is not None

    # -- the relay --------------------------------------------------------------------------------
    def mark_due(
        self,
        engine: Engine,
        status: Status,
        *,
        leased_ok: bool,
        batch: int,
        republish_after_s: float,
        fresh_grace_s: float,
        leading_since: dt.datetime | None,
        write: bool = True,
    ) -> list[Any]:
        """Select due rows and mark them published in one UPDATE (no NOTIFY path: no grace);
        ``write`` False: the same rows, read only."""
        conds = [
            _OP.c.status == status.value,
            _OP.c.next_attempt_at <= db_now(),
            or_(
                _OP.c.published_at.is_(None),
                _OP.c.published_at < _OP.c.next_attempt_at,
                _OP.c.published_at < db_now(-republish_after_s),
            ),
        ]
        if not leased_ok:
            conds.append(or_(_OP.c.lease_expires_at.is_(None), _OP.c.lease_expires_at < db_now()))
        # Rung in the order the claim serves a tenant's rows, so a high priority's doorbell goes first.
        order = (
            (_OP.c.priority.desc(), _OP.c.next_attempt_at)
            if status is Status.NOT_DISPATCHED
            else (_OP.c.next_attempt_at,)
        )
        if not write:
            with engine.begin() as conn:
                picked = select(_OP.c.id, db_age_s(_OP.c.next_attempt_at)).where(*conds).order_by(*order).limit(batch)
                return list(conn.execute(picked).all())
        due = select(_OP.c.id).where(*conds).order_by(*order).limit(batch)
        stmt = update(_OP).where(_OP.c.id.in_(due.scalar_subquery()))
        with engine.begin() as conn:
            return list(
                conn.execute(
                    stmt.values(published_at=db_now()).returning(_OP.c.id, db_age_s(_OP.c.next_attempt_at))
                ).all()
            )

    def mark_rung(self, engine: Engine, operation_ids: Sequence[str]) -> None:
        with engine.begin() as conn:
            conn.execute(
                update(_OP)
                .where(
                    _OP.c.id.in_(list(operation_ids)),
                    _OP.c.status == Status.NOT_DISPATCHED.value,
                    _OP.c.published_at.is_(None),
                )
                .values(published_at=db_now())
            )

    def listener(self, engine: Engine) -> None:
        return None  # nothing notifies: the relay polls


class SessionHotPath:
    """On SQLite a worker's claims and finalizes are plain sessions: nothing to gain from more."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def one_statement(self) -> AbstractContextManager[Any]:
        return self._begin()

    def transaction(self) -> AbstractContextManager[Any]:
        return self._begin()

    @contextmanager
    def _begin(self) -> Iterator[Session]:
        with self.sessions.begin() as session:
            yield session

    def close(self) -> None:
        pass
