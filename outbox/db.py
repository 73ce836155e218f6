"""Engines and sessions for the ledger, with the per-dialect settings it relies on.

SQLite (the embedded default) is made safe for several processes: WAL journal, a busy timeout,
and ``BEGIN IMMEDIATE`` for every transaction so that two writers never deadlock while upgrading
a read lock (SQLite does not retry that case, the busy timeout only covers waiting for a lock).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

# Long enough to ride out another process's commit burst on a laptop disk; short enough that
# a stuck writer surfaces as an error instead of a hang.
SQLITE_BUSY_TIMEOUT_MS = 30_000


def is_postgres(bind: Any) -> bool:
    """True for a PostgreSQL engine, session or connection (SQLAlchemy's or psycopg's own)."""
    if isinstance(bind, Session):
        bind = bind.get_bind()
    elif isinstance(bind, Connection):
        bind = bind.engine
    elif not isinstance(bind, Engine):
        return True  # a psycopg connection (outbox.ledger_connection)
    return bool(bind.dialect.name == "postgresql")


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for the ledger; use it (or its settings) for the agent's own session too."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)
        _make_sqlite_transactional(engine)
        return engine
    # No pool pre-ping by default: it costs a round trip and (with psycopg) a counted transaction
    # per checkout, doubling commits per operation (bench/README.md). A connection that died in
    # the pool fails its first use, SQLAlchemy invalidates the pool, and callers retry.
    return create_engine(url, **kwargs)


def _make_sqlite_transactional(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the sqlite3 module, decide where transactions begin.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        # WAL + NORMAL is durable against process crashes; only an OS crash may lose the last
        # commits, which the embedded (laptop) mode accepts. Production runs PostgreSQL.
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def driver_connection(bind: Any) -> Any:
    """The DBAPI (psycopg) connection under a session's or connection's current transaction.

    The hot path (submit, claim, finalize) sends its few fixed statements straight to the driver:
    SQLAlchemy's per-execute work (result metadata, parameter processing) cost more client CPU than
    PostgreSQL spent running them (bench/README.md). The statements still run inside the caller's
    transaction: SQLAlchemy began it and will commit or roll it back.
    """
    if isinstance(bind, Session):
        return bind.connection().connection.driver_connection
    if isinstance(bind, Connection):
        return bind.connection.driver_connection
    return bind  # already the driver's connection


def driver_sql(sql: str) -> str:
    """SQL written with ``:name`` parameters, as psycopg wants them (``%(name)s``); ``::`` casts stay."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql)
