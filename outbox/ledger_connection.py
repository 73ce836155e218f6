"""A worker process's own connection to the ledger, for the hot path (claim, finalize).

A worker's claim is one statement and needs no transaction around it; a doorbell's finalize is a
few statements that commit together. Through a SQLAlchemy session each of those transactions cost
a pool checkout, a BEGIN round trip, a COMMIT round trip and the session's own bookkeeping: more
than PostgreSQL spent running the statements (bench/README.md). So on PostgreSQL a worker keeps one
psycopg connection in autocommit mode:

- ``one_statement()``: the statement is its own transaction (one round trip, no BEGIN/COMMIT);
- ``transaction()``: BEGIN ... COMMIT around several statements (rolled back on an exception).

``outbox.claims``, ``outbox.transitions`` and ``outbox.evidence`` accept that connection wherever
they accept a session. On SQLite both are ``sessions.begin()``: nothing to gain there, and the
portable code paths need a session.

A connection that fails is dropped; the next call connects again (the doorbell that failed is
re-published by the relay, and an open lease expires into outcome_unknown as always).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.db import is_postgres, make_sessionmaker


class LedgerConnection:
    def __init__(self, engine: Engine, sessions: sessionmaker[Session] | None = None) -> None:
        self.engine = engine
        self.sessions = sessions or make_sessionmaker(engine)
        self.postgres = is_postgres(engine)
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
            self._conn = conn
        return self._conn

    def one_statement(self) -> AbstractContextManager[Any]:
        """A psycopg connection whose next statement commits by itself (SQLite: a session)."""
        return self._held(begin=False)

    def transaction(self) -> AbstractContextManager[Any]:
        """Several statements committed together (SQLite: a session)."""
        return self._held(begin=True)

    @contextmanager
    def _held(self, *, begin: bool) -> Iterator[Any]:
        if not self.postgres:
            with self.sessions.begin() as session:
                yield session
            return
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
