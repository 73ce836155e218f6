"""Engines and sessions for the ledger; each database's settings live in its driver.

``make_engine`` asks the driver of the URL's database (outbox/ledger/drivers/) to build the engine: the
SQLite driver makes the file safe for several processes, the PostgreSQL driver keeps the pool lean.
``make_async_engine`` does the same for an asyncio application (``producer.AsyncOutbox``).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import MissingDependency
from outbox.ledger.drivers import driver_for_url

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

ASYNC_HINT = (
    "an async engine needs SQLAlchemy's asyncio extra (greenlet): pip install 'agent-outbox-ledger[asyncio]' "
    "(or '[asyncpg]' for asyncpg)"
)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for the ledger; use it (or its settings) for the agent's own session too."""
    return driver_for_url(url).make_engine(url, **kwargs)


# How long a connection to one ledger of a fleet (OUTBOX_DATABASE_URLS) may take to open: a ledger
# whose host stopped answering must not hold the fleet's shared threads for the operating system's
# TCP timeout (about 2 minutes on Linux).
FLEET_CONNECT_TIMEOUT_S = 5


def connect_timeout_args(url: str, seconds: int) -> dict[str, Any]:
    """make_engine's keyword arguments for a connect timeout on PostgreSQL (nothing for SQLite, nor
    when the URL sets its own ``connect_timeout``: the user's wins)."""
    if not url.startswith("postgresql") or "connect_timeout" in make_url(url).query:
        return {}
    return {"connect_args": {"connect_timeout": seconds}}


# How long a server process's request waits for one of its kept connections (SQLAlchemy's default).
SERVER_POOL_WAIT_S = 30.0


def kept_pool_args(url: str, connections: int, wait_s: float) -> dict[str, Any]:
    """make_engine's keyword arguments for a server process's pool on PostgreSQL: up to
    ``connections`` opened as requests need them and then kept, a request beyond them waiting up to
    ``wait_s`` for one (then SQLAlchemy's pool TimeoutError). SQLAlchemy's default pool keeps five
    and closes every other connection on its return: under more concurrent requests than five, a
    new PostgreSQL backend and a new connect every few requests. SQLite's own pool is left as it is."""
    if not url.startswith("postgresql"):
        return {}
    return {"pool_size": connections, "max_overflow": 0, "pool_timeout": wait_s}


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def make_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine on the ledger's database (``postgresql+asyncpg://``, or ``postgresql+psycopg://``
    through psycopg's async connection, or a SQLite file through aiosqlite). A URL of a sync-only
    driver (``postgresql://``: psycopg2; ``sqlite://``) opens the same database through an async one."""
    if importlib.util.find_spec("greenlet") is None:
        raise MissingDependency(ASYNC_HINT)
    return driver_for_url(url, asynchronous=True).make_async_engine(url, **kwargs)


def make_async_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    from sqlalchemy.ext import asyncio

    return asyncio.async_sessionmaker(engine, expire_on_commit=False)


def unreachable(engine: Engine) -> Exception | None:
    """Why the ledger does not answer a trivial query now, or None when it does (readiness probes:
    the API's /readyz, `agent-outbox health --ledger`)."""
    try:
        with engine.connect() as conn:
            conn.execute(select(1))
    except Exception as exc:  # noqa: BLE001 - reported by the caller, not raised
        return exc
    return None
