"""A worker process's own way to the ledger, for the hot path (claim, finalize).

A worker's claim is one statement and needs no transaction around it; a doorbell's finalize is a
few statements that commit together. Through a SQLAlchemy session each of those transactions cost
a pool checkout, a BEGIN round trip, a COMMIT round trip and the session's own bookkeeping: more
than PostgreSQL spent running the statements. So on PostgreSQL a worker keeps one
psycopg connection in autocommit mode (``PostgresDriver.hot_path``):

- ``one_statement()``: the statement is its own transaction (one round trip, no BEGIN/COMMIT);
- ``transaction()``: BEGIN ... COMMIT around several statements (rolled back on an exception).

``outbox.ledger.claims``, ``outbox.ledger.transitions`` and ``outbox.evidence.sinks`` accept what these yield wherever
they accept a session. On SQLite both are ``sessions.begin()``: nothing to gain there.

A connection that fails is dropped; the next call connects again (the doorbell that failed is
re-published by the relay, and an open lease expires into outcome_unknown as always).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.db import make_sessionmaker
from outbox.ledger.drivers import driver_for


class LedgerConnection:
    def __init__(self, engine: Engine, sessions: sessionmaker[Session] | None = None) -> None:
        self.engine = engine
        self.sessions = sessions or make_sessionmaker(engine)
        self._path = driver_for(engine).hot_path(engine, self.sessions)

    def one_statement(self) -> AbstractContextManager[Any]:
        """A connection whose next statement commits by itself (SQLite: a session)."""
        return self._path.one_statement()

    def transaction(self) -> AbstractContextManager[Any]:
        """Several statements committed together (SQLite: a session)."""
        return self._path.transaction()

    def close(self) -> None:
        self._path.close()
