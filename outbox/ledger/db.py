"""Engines and sessions for the ledger; each database's settings live in its driver.

``make_engine`` asks the driver of the URL's database (outbox/ledger/drivers/) to build the engine: the
SQLite driver makes the file safe for several processes, the PostgreSQL driver keeps the pool lean.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.drivers import driver_for_url


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for the ledger; use it (or its settings) for the agent's own session too."""
    return driver_for_url(url).make_engine(url, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)
