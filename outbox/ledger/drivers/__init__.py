"""Ledger drivers: one implementation of the ledger's statements per database.

``driver_for(bind)`` is the one place that asks which database the ledger runs on; everything
else calls the driver it returns (outbox/ledger/drivers/base.py says what a driver does).

The PostgreSQL driver is imported when a PostgreSQL ledger is first asked for. psycopg cannot be
imported without an implementation (its ``binary`` or ``c`` package, or the system's libpq): a SQLite
ledger needs none, and neither does a session on another driver (psycopg2, asyncpg: an application's
own, e.g. Django's on psycopg2, producer/django/), whose statements go through SQLAlchemy. A URL (the
tools, the workers) or a session on psycopg needs psycopg, and is refused without it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from outbox.errors import MissingDependency
from outbox.ledger.drivers.base import ClaimedRow, FinalizeWrite, LedgerDriver, NewOperation
from outbox.ledger.drivers.sqlite import SqliteDriver

SQLITE = SqliteDriver()

__all__ = ["ClaimedRow", "FinalizeWrite", "LedgerDriver", "NewOperation", "driver_for", "driver_for_url"]

PSYCOPG_HINT = (
    "a PostgreSQL ledger needs a psycopg implementation: pip install 'agent-outbox-ledger[binary]' "
    "(prebuilt, libpq included), or pip install 'psycopg[c]' (built against the system's libpq)"
)


# SQLAlchemy's drivers on which the PostgreSQL driver sends its statements through psycopg itself.
_ON_PSYCOPG = {"psycopg", "psycopg_async"}


def _postgres(*, psycopg: bool = True) -> LedgerDriver:
    if psycopg:
        _psycopg_importable()
    return _postgres_driver()


@functools.cache
def _psycopg_importable() -> None:
    try:
        import psycopg as _  # noqa: F401 - importable, with an implementation
    except ImportError as exc:
        if not (exc.name or "").startswith("psycopg") and "psycopg" not in str(exc):
            raise
        # psycopg says which implementations it tried ("no pq wrapper available"), not what to install.
        raise MissingDependency(f"{PSYCOPG_HINT}; psycopg said: {' '.join(str(exc).split())}") from exc


@functools.cache
def _postgres_driver() -> LedgerDriver:
    from outbox.ledger.drivers.postgres import PostgresDriver

    return PostgresDriver()


def __getattr__(name: str) -> LedgerDriver:
    if name == "POSTGRES":
        return _postgres()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _by_backend(backend: str, *, psycopg: bool = True) -> LedgerDriver:
    if backend == "postgresql":
        return _postgres(psycopg=psycopg)
    if backend == "sqlite":
        return SQLITE
    raise KeyError(backend)


def driver_for_url(url: str, *, asynchronous: bool = False) -> LedgerDriver:
    """The driver of a URL. ``asynchronous``: the URL of an async engine, which on asyncpg needs no
    psycopg implementation (every other PostgreSQL URL opens through psycopg's async connection)."""
    parsed = make_url(url)
    try:
        return _by_backend(
            parsed.get_backend_name(), psycopg=not (asynchronous and parsed.get_driver_name() == "asyncpg")
        )
    except KeyError:
        raise ValueError(
            f"unsupported ledger database {parsed.get_backend_name()!r}: use postgresql+psycopg://... or sqlite:///..."
        ) from None


def driver_for(bind: Any) -> LedgerDriver:
    """The driver of an engine, session or connection (SQLAlchemy's, or a worker's psycopg one)."""
    if isinstance(bind, Session):
        bind = bind.get_bind()
    elif isinstance(bind, Connection):
        bind = bind.engine
    elif (psycopg := sys.modules.get("psycopg")) is not None and isinstance(bind, psycopg.Connection):
        return _postgres()  # a worker's own connection (PostgresDriver.hot_path); never one without psycopg
    elif not isinstance(bind, Engine):
        raise TypeError(f"not a ledger engine, session or connection: {type(bind).__name__}")
    return _by_backend(bind.dialect.name, psycopg=bind.dialect.driver in _ON_PSYCOPG)
