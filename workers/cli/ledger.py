"""The ledger as a command opens it: the engine (the embedded default migrates itself; a server's
ledger must be migrated first), and ``ledger()`` for a command that opens it, runs, and closes it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from outbox import migrate
from outbox.errors import OutboxError
from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.settings import Settings, load_settings


class LedgerUnavailable(OutboxError):
    """The ledger database cannot be reached or has no schema yet."""


def open_engine(settings: Settings, *, ensure_schema: bool = True) -> Engine:
    """Engine on the configured ledger. The embedded default migrates itself; a server does not."""
    url = settings.resolved_database_url
    engine = make_engine(url)
    if not ensure_schema:
        return engine
    try:
        current = migrate.current_revision(engine)
        if current != migrate.head_revision():
            if not settings.database_url:
                migrate.upgrade(engine)  # embedded default: nobody else to run migrate
            else:
                raise LedgerUnavailable(
                    f"the ledger schema is at {current or 'nothing'}, not {migrate.head_revision()}: "
                    "run `agent-outbox migrate` first"
                )
    except OperationalError as exc:
        raise LedgerUnavailable(
            f"cannot reach the ledger at {engine.url.render_as_string(hide_password=True)}: "
            f"{exc.orig}; check OUTBOX_DATABASE_URL"
        ) from exc
    return engine


@contextmanager
def ledger(settings: Settings | None = None) -> Iterator[sessionmaker[Session]]:
    """The configured ledger for the length of one command: ``with ledger() as sessions:``; each
    ``sessions()`` or ``sessions.begin()`` is the command's own transaction."""
    engine = open_engine(settings or load_settings())
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()
