"""The ledger as a command opens it: the engine (the embedded default migrates itself; a server's
ledger must be migrated first), and ``ledger()`` for a command that opens it, runs, and closes it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from outbox import migrate
from outbox.errors import OutboxError
from outbox.ledger.db import (
    FLEET_CONNECT_TIMEOUT_S,
    SERVER_POOL_WAIT_S,
    connect_timeout_args,
    kept_pool_args,
    make_engine,
    make_sessionmaker,
)
from outbox.settings import Settings, load_settings


class LedgerUnavailable(OutboxError):
    """The ledger database cannot be reached or has no schema yet."""


class LedgerUnreachable(LedgerUnavailable):
    """The ledger database cannot be reached (its schema is unknown, not wrong)."""


def open_engine(
    settings: Settings, *, ensure_schema: bool = True, ledger: str | None = None, serving: bool = False
) -> Engine:
    """Engine on the configured ledger (``ledger``: that one of OUTBOX_DATABASE_URLS instead). The
    embedded default migrates itself; a server does not. ``serving``: a server process's pool, its
    OUTBOX_API_DB_CONNECTIONS opened as requests need them and kept (db.py kept_pool_args)."""
    named = ledger is not None
    url = settings.ledger_urls[ledger] if named else settings.resolved_database_url
    args = connect_timeout_args(url, FLEET_CONNECT_TIMEOUT_S) if named else {}
    if serving:
        args |= kept_pool_args(url, settings.api_db_connections, SERVER_POOL_WAIT_S)
    engine = make_engine(url, **args)
    if not ensure_schema:
        return engine
    try:
        current = migrate.current_revision(engine)
        if current != migrate.head_revision():
            if not settings.database_url and not named:
                migrate.upgrade(engine)  # embedded default: nobody else to run migrate
            else:
                how = "agent-outbox migrate --ledgers" if named else "agent-outbox migrate"
                which = f"ledger {ledger} ({shown(engine.url)})" if named else f"the ledger at {shown(engine.url)}"
                raise LedgerUnavailable(
                    f"the schema of {which} is at {current or 'nothing'}, not {migrate.head_revision()}: "
                    f"run `{how}` first"
                )
    except OperationalError as exc:
        which = f"ledger {ledger} at {shown(engine.url)}" if named else f"the ledger at {shown(engine.url)}"
        raise LedgerUnreachable(
            f"cannot reach {which}: {exc.orig}; check {'OUTBOX_DATABASE_URLS' if named else 'OUTBOX_DATABASE_URL'}"
        ) from exc
    return engine


def shown(url: str | URL) -> str:
    """A ledger's URL as printed to a terminal or a log: without its password."""
    return make_url(url).render_as_string(hide_password=True)


@contextmanager
def ledger(settings: Settings | None = None) -> Iterator[sessionmaker[Session]]:
    """The configured ledger for the length of one command: ``with ledger() as sessions:``; each
    ``sessions()`` or ``sessions.begin()`` is the command's own transaction."""
    engine = open_engine(settings or load_settings())
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()
