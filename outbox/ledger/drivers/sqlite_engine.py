"""SQLite engines for the ledger, sync and async: one file shared safely by several processes.

WAL journal, a busy timeout, and ``BEGIN IMMEDIATE`` for every transaction, so that two writers
never deadlock while upgrading a read lock (SQLite does not retry that case; the busy timeout only
covers waiting for a lock). An async engine (aiosqlite, for ``producer.AsyncOutbox`` on the embedded
default) gets the same settings through its sync facade's events.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from outbox.errors import MissingDependency

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

# Long enough to ride out another process's commit burst on a laptop disk; short enough that
# a stuck writer surfaces as an error instead of a hang.
SQLITE_BUSY_TIMEOUT_MS = 30_000

AIOSQLITE_HINT = "an async SQLite ledger needs aiosqlite: pip install 'agent-outbox-ledger[asyncio]'"


def _prepare(url: str) -> Any:
    parsed = make_url(url)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    return parsed


def _configure(engine: Engine) -> None:
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


def make_engine(url: str, **kwargs: Any) -> Engine:
    engine = create_engine(_prepare(url), connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)
    _configure(engine)
    return engine


def make_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """The same file through aiosqlite (a ``sqlite://`` URL is opened as ``sqlite+aiosqlite://``)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    parsed = _prepare(url)
    if parsed.drivername in ("sqlite", "sqlite+pysqlite"):
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    try:
        engine = create_async_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)
    except ImportError as exc:
        raise MissingDependency(f"{AIOSQLITE_HINT} ({exc})") from exc
    _configure(engine.sync_engine)
    return engine
