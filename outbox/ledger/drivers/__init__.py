"""Ledger drivers: one implementation of the ledger's statements per database.

``driver_for(bind)`` is the one place that asks which database the ledger runs on; everything
else calls the driver it returns (outbox/ledger/drivers/base.py says what a driver does).
"""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from outbox.ledger.drivers.base import ClaimedRow, FinalizeWrite, LedgerDriver, NewOperation
from outbox.ledger.drivers.postgres import PostgresDriver
from outbox.ledger.drivers.sqlite import SqliteDriver

POSTGRES = PostgresDriver()
SQLITE = SqliteDriver()
_BY_BACKEND: dict[str, LedgerDriver] = {"postgresql": POSTGRES, "sqlite": SQLITE}

__all__ = ["ClaimedRow", "FinalizeWrite", "LedgerDriver", "NewOperation", "driver_for", "driver_for_url"]


def driver_for_url(url: str) -> LedgerDriver:
    backend = make_url(url).get_backend_name()
    try:
        return _BY_BACKEND[backend]
    except KeyError:
        raise ValueError(
            f"unsupported ledger database {backend!r}: use postgresql+psycopg://... or sqlite:///..."
        ) from None


def driver_for(bind: Any) -> LedgerDriver:
    """The driver of an engine, session or connection (SQLAlchemy's, or a worker's psycopg one)."""
    if isinstance(bind, Session):
        bind = bind.get_bind()
    elif isinstance(bind, Connection):
        bind = bind.engine
    elif isinstance(bind, psycopg.Connection):
        return POSTGRES  # a worker's own connection (PostgresDriver.hot_path)
    elif not isinstance(bind, Engine):
        raise TypeError(f"not a ledger engine, session or connection: {type(bind).__name__}")
    return _BY_BACKEND[bind.dialect.name]
