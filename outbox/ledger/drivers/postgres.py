"""The PostgreSQL ledger driver: the catalogue's statements, sent straight through psycopg.

Every statement runs inside the caller's transaction (a SQLAlchemy session or connection, whose
driver connection we borrow, or a worker's own psycopg connection from ``hot_path``): SQLAlchemy
began it and commits or rolls it back. Several finalizes are pipelined: one round trip for a
whole doorbell batch.

An application's own transaction may run on another driver: psycopg2 (SQLAlchemy's default for
``postgresql://``), asyncpg or psycopg's async connection (an ``AsyncSession``, whose sync session
``run_sync`` hands us: producer/aio.py). There the same catalogue statements go through
SQLAlchemy (``text()`` on the caller's session), so they are one text and one meaning on every
driver; only a sync psycopg connection takes the raw path, which the workers' hot path and the
submit benchmarks measure.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, TextClause, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import MissingDependency
from outbox.ledger.drivers import pg_moves as moves
from outbox.ledger.drivers import pg_statements as sql
from outbox.ledger.drivers.base import FinalizeWrite, Inserted, NewOperation, StaleRules
from outbox.ledger.fairness import Fairness, FairnessMode
from outbox.ledger.models import Run, core_table
from outbox.ledger.states import AttemptKind, Status

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

try:
    import psycopg
    from psycopg.rows import namedtuple_row
except ImportError:  # no implementation: sessions on another driver only (drivers/__init__.py)
    if not TYPE_CHECKING:
        psycopg = None

# Drivers SQLAlchemy runs only synchronously: their URLs open the same database through psycopg's
# async connection (psycopg is a core dependency) when an async engine is asked for.
_SYNC_ONLY = {"postgresql", "postgresql+psycopg2", "postgresql+psycopg2cffi", "postgresql+pg8000"}
ASYNCPG_HINT = "postgresql+asyncpg:// needs asyncpg: pip install 'agent-outbox-ledger[asyncpg]'"


def _raw(bind: Any) -> psycopg.Connection[Any] | None:
    """The sync psycopg connection under a session's or connection's current transaction (or a
    worker's own); None when another driver carries it, so the statement goes through SQLAlchemy."""
    if isinstance(bind, Session):
        conn = bind.connection().connection.driver_connection
    elif isinstance(bind, Connection):
        conn = bind.connection.driver_connection
    else:
        conn = bind  # already the driver's connection (a worker's hot path)
    return conn if psycopg is not None and isinstance(conn, psycopg.Connection) else None


@functools.lru_cache(maxsize=128)
def _text(statement: str) -> TextClause:
    return text(sql.named(statement))


def _execute(bind: Any, statement: str, params: dict[str, Any], *, by_name: bool = True) -> Any:
    """Run one catalogue statement in ``bind``'s transaction; a cursor or a result. ``by_name``: rows
    read by column name (else by position: psycopg's plain tuples, the cheapest)."""
    raw = _raw(bind)
    if raw is not None:
        return (
            raw.cursor(row_factory=namedtuple_row).execute(statement, params)
            if by_name
            else raw.execute(statement, params)
        )
    return bind.execute(_text(statement), params)


def _rows(bind: Any, statement: str, params: dict[str, Any]) -> list[Any]:
    rows: list[Any] = _execute(bind, statement, params).fetchall()
    return rows


def _generic_rows(bind: Any, statement: str, params: dict[str, Any]) -> list[Any]:
    """``_rows`` on the statement's cached generic plan, never a custom one (on psycopg).

    PostgreSQL plans a prepared statement afresh while a custom plan looks cheaper than the
    generic one, and a custom plan priced for the ids actually given looks cheaper than the
    generic one priced for ten whenever fewer come: the hot path's claim (~1 ms to plan, more than
    to run it), its doorbell reads and its finalize were planned on most calls in some runs, not
    in others. Their statuses and limits are literals in the text, so
    the generic plans read the same partial indexes. Set, run, set back: one pipeline, one round
    trip, as the statement alone."""
    conn = _raw(bind)
    if conn is None:
        return _rows(bind, statement, params)
    with _on_generic_plans(conn):
        cursor = conn.cursor(row_factory=namedtuple_row)
        cursor.execute(statement, params)
    return cursor.fetchall()


@contextmanager
def _on_generic_plans(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A pipeline whose statements run on their generic plans (_generic_rows says why): the setting
    set before them and put back after, in the same round trip."""
    with conn.pipeline():
        conn.execute(sql.GENERIC_PLANS)
        yield
        conn.execute(sql.PLANS_AS_BEFORE)


LISTEN_CONNECT_TIMEOUT_S = 10


class PostgresDriver:
    name = "postgresql"

    def make_engine(self, url: str, **kwargs: Any) -> Engine:
        # No pool pre-ping by default: it costs a round trip and (with psycopg) a counted
        # transaction per checkout, doubling commits per operation. A connection
        # that died in the pool fails its first use, SQLAlchemy invalidates the pool, callers retry.
        return create_engine(url, **kwargs)

    def make_async_engine(self, url: str, **kwargs: Any) -> AsyncEngine:
        from sqlalchemy.ext.asyncio import create_async_engine

        parsed = make_url(url)
        if parsed.drivername in _SYNC_ONLY:
            parsed = parsed.set(drivername="postgresql+psycopg")
        try:
            return create_async_engine(parsed, **kwargs)
        except ImportError as exc:  # the URL names asyncpg, and it is not installed
            raise MissingDependency(f"{ASYNCPG_HINT} ({exc})") from exc

    def lock_for_migration(self, conn: Connection) -> None:
        conn.exec_driver_sql(sql.MIGRATION_LOCK_SQL)

    def migrating(self, conn: Connection) -> AbstractContextManager[None]:
        return nullcontext()

    def set_statement_timeout(self, session: Session, ms: int) -> None:
        session.connection().exec_driver_sql(sql.statement_timeout(ms))

    def hot_path(self, engine: Engine, sessions: sessionmaker[Session]) -> PgHotPath:
        return PgHotPath(engine)

    # -- writes of the state machine -------------------------------------------------------------
    def insert_operation(self, session: Any, new: NewOperation) -> Inserted | None:
        statement = sql.SUBMIT_NOTIFY if new.status is Status.NOT_DISPATCHED else sql.SUBMIT_QUIET
        params: dict[str, Any] = {name: getattr(new, name) for name in sql.SUBMIT_AS_GIVEN}
        params.update(
            key=new.idempotency_key,
            digest=new.args_digest,
            status=new.status.value,
            waiting_for=new.waiting_for.value if new.waiting_for else None,
        )
        row = _execute(session, statement, params, by_name=False).fetchone()
        return None if row is None else Inserted(*row[:4])

    def notify_due(self, session: Any, operation_id: str) -> None:
        _execute(session, sql.NOTIFY_DUE, {"id": operation_id}, by_name=False)

    def claim(
        self,
        session: Any,
        kind: AttemptKind,
        *,
        worker: str,
        lease_s: float,
        limit: int,
        operation_ids: list[str] | None,
        also_due: int,
        fairness: Fairness | None = None,
        versions: Mapping[str, str] | None = None,
    ) -> list[Any]:
        fair = fairness is not None and fairness.on
        ids_fit = operation_ids is not None and len(operation_ids) <= limit
        statement = sql.claim(kind, operation_ids is not None, limit, also_due, fair, ids_fit)
        params: dict[str, Any] = {"operation_ids": operation_ids, "worker": worker, "lease_s": float(lease_s)}
        if kind is AttemptKind.DISPATCH:  # the walk of the tenants (with no fairness: from the first)
            params.update((fairness or Fairness(FairnessMode.OFF)).claim_params())
            if operation_ids is None:
                params["operation_ids"] = []
            params["versions"] = json.dumps(dict(versions)) if versions else None
        return _generic_rows(session, statement, params)

    def finalize(self, session: Any, writes: Sequence[FinalizeWrite]) -> list[tuple[bool, bool]]:
        """Each write's (attempt row written, operation moved), pipelined in one round trip."""
        if not writes:
            return []
        rows = [moves.finalize_params(w) for w in writes]
        conn = _raw(session)
        if conn is None:  # another driver: one statement after the other
            found = [
                _execute(session, moves.finalize(w.to, w.refund, w.guard, w.source), p).fetchone()
                for w, p in zip(writes, rows)
            ]
            return [(bool(row.wrote), bool(row.moved)) for row in found]
        out: list[tuple[bool, bool]] = [(False, False)] * len(writes)
        with _on_generic_plans(conn):
            sent = []
            for statement, params, members in moves.finalize_batch(writes, rows):
                cursor = conn.cursor()
                cursor.execute(statement, params)
                sent.append((members, cursor))
        for members, cursor in sent:
            for i, (wrote, moved) in zip(members, cursor.fetchall(), strict=True):
                out[i] = (bool(wrote), bool(moved))
        return out

    def current_row(self, session: Any, operation_id: str) -> Any:
        return _execute(session, sql.CURRENT_ROW, {"id": operation_id}).fetchone()

    def mark_attempt_stale(self, session: Any, attempt_id: int) -> None:
        _execute(session, sql.MARK_ATTEMPT_STALE, {"id": attempt_id}, by_name=False)

    def record_request(self, session: Any, operation_id: str, params: dict[str, Any]) -> bool:
        row = _execute(session, sql.RECORD_IF_NONE, {**params, "operation_id": operation_id}, by_name=False)
        return row.fetchone() is not None

    # -- reads of the hot path --------------------------------------------------------------------
    def read_due(self, session: Any, operation_ids: Sequence[str]) -> list[Any]:
        return _generic_rows(session, sql.READ_DUE, {"ids": list(operation_ids)})

    def attempt_log(self, session: Any, operation_ids: Sequence[str], columns: tuple[str, ...]) -> list[Any]:
        return _generic_rows(session, sql.attempt_log(columns), {"ids": list(operation_ids)})

    def insert_evidence(self, session: Any, records: Sequence[dict[str, Any]]) -> None:
        raw = _raw(session)
        if raw is None:
            session.execute(_text(sql.INSERT_EVIDENCE), list(records))
        else:
            # One statement for the batch (one executor start, not one per record).
            doc = moves.json_rows(records, sql.EVIDENCE_COLUMNS)
            if doc is None:  # a value JSON cannot spell (these columns are text: not expected)
                raw.cursor().executemany(sql.INSERT_EVIDENCE, list(records))
            else:
                raw.execute(sql.INSERT_EVIDENCE_ROWS, {"rows": doc})

    def analyze_stale(
        self, conn: Any, tables: Sequence[str], rules: StaleRules, seen: dict[str, int] | None = None
    ) -> list[str]:
        seen = {} if seen is None else seen  # without a caller's memory, every analysis is a first one
        params = vars(rules) | {"tables": list(tables), "marks": [seen.get(t) for t in tables]}
        found = [row for row in _rows(conn, sql.STALE_STATISTICS, params) if row.relname in tables]
        rules.young = {row.relname for row in found if row.young}
        stale = [row for row in found if row.stale]
        for row in stale:  # names the caller gave, as PostgreSQL returned them
            some = row.relname in seen and row.searched  # all columns the first time, then the searched ones
            conn.exec_driver_sql(f"ANALYZE {row.relname} ({row.searched})" if some else f"ANALYZE {row.relname}")
            seen[row.relname] = row.changes
        return [row.relname for row in stale]

    def upsert(self, table: Any) -> Any:
        from sqlalchemy.dialects.postgresql import insert as dialect_insert

        return dialect_insert(table)

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
        with engine.begin() as conn:
            params = {
                "republish_after_s": float(republish_after_s),
                "fresh_grace_s": float(fresh_grace_s),
                "leading_since": leading_since,
            }
            return _rows(conn, sql.mark_due(status, leased_ok, batch, write), params)

    def mark_rung(self, engine: Engine, operation_ids: Sequence[str]) -> None:
        with engine.begin() as conn:
            _execute(conn, sql.MARK_RUNG, {"ids": list(operation_ids)}, by_name=False)

    def listener(self, engine: Engine) -> Listener:
        return Listener(engine)


class Listener:
    """A LISTEN connection for the relay: notified ids, and the NOTIFY-leader lock.

    Raises ``psycopg.Error`` (a database error) when the connection fails; the relay reconnects.
    """

    errors: tuple[type[Exception], ...] = (psycopg.Error,) if psycopg is not None else ()

    def __init__(self, engine: Engine) -> None:
        url = make_url(engine.url).set(drivername="postgresql")
        # A connect timeout (the URL's own wins): a ledger host that stopped answering is retried, not
        # waited on for the operating system's TCP timeout (a relay may serve several ledgers).
        if "connect_timeout" not in url.query:
            url = url.update_query_dict({"connect_timeout": str(LISTEN_CONNECT_TIMEOUT_S)})
        self._url = url.render_as_string(hide_password=False)
        self._conn: psycopg.Connection[Any] | None = None

    @contextmanager
    def connected(self) -> Iterator[Listener]:
        with psycopg.connect(self._url, autocommit=True) as conn:
            conn.execute(sql.LISTEN)
            self._conn = conn
            try:
                yield self
            finally:
                self._conn = None

    def fileno(self) -> int:
        assert self._conn is not None
        return self._conn.fileno()

    def drain(self) -> list[str]:
        """Every notification waiting now: the ids submit notified."""
        assert self._conn is not None
        return [n.payload for n in self._conn.notifies(timeout=0) if n.payload]

    def try_lead(self) -> dt.datetime | None:
        """Take the NOTIFY-leader lock if free; the database's time then, or None (not leading)."""
        assert self._conn is not None
        row = self._conn.execute(sql.TRY_LEAD, {"key": sql.NOTIFY_LEADER_LOCK}).fetchone()
        return row[1] if row and row[0] else None


class PgHotPath:
    """A worker process's own psycopg connection, in autocommit mode (outbox/ledger/hot_path.py)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()  # one statement at a time on the one connection

    def _connect(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            # Through the engine's pool so its connect arguments and events apply; detached, so
            # the pool neither resets nor hands this connection to anyone else.
            fairy = self.engine.raw_connection()
            conn = fairy.driver_connection
            assert isinstance(conn, psycopg.Connection)
            fairy.detach()
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.rollback()
            conn.autocommit = True
            # Prepared at the first run, not psycopg's fifth: until then PostgreSQL plans a statement
            # every run, and a claim (its limits literals: pg_statements.py) costs more to plan than
            # to run. None (no prepared statements: an old PgBouncer) stays None. ~65 texts at the
            # default doorbell batch fit psycopg's cache of 100; near batch 100 the rarest re-prepare.
            if conn.prepare_threshold is not None:
                conn.prepare_threshold = 0
            self._conn = conn
        return self._conn

    def one_statement(self) -> AbstractContextManager[Any]:
        return self._held(begin=False)

    def transaction(self) -> AbstractContextManager[Any]:
        return self._held(begin=True)

    @contextmanager
    def _held(self, *, begin: bool) -> Iterator[Any]:
        with self._lock:
            conn = self._connect()
            try:
                if begin:
                    with conn.transaction():
                        yield conn
                else:
                    yield conn
            except psycopg.OperationalError:
                self._drop()
                raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def close(self) -> None:
        with self._lock:
            self._drop()
