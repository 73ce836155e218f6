"""Django's connection lent to a SQLAlchemy session for one call, on either of Django's PostgreSQL
drivers: psycopg 3 (``postgresql+django_psycopg``) or psycopg2 (``postgresql+django_psycopg2``).

Both dialects are SQLAlchemy's own for the driver with the same few rules (``_Lent``): the transaction
is Django's, so nothing here commits, rolls back or closes the connection; and Django's connection is
configured as Django likes it, so nothing is added to it on "connect" (which here is every call). What
differs per driver is only how Django's loaders are set aside for the call (``Driver``).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from django.db.transaction import TransactionManagementError
from sqlalchemy import Engine, create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.base import PGDialect
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.pool import NullPool


class _Lent:
    """The rules of a lent connection, over SQLAlchemy's dialect for its driver.

    The session's end "rolls back" (SQLAlchemy's habit when a session closes uncommitted, and after
    the first connect's initialisation) into nothing, and ``atomic()`` decides. A commit asked of it
    is a bug in the ledger, refused rather than obeyed.
    """

    supports_statement_cache = True

    def do_commit(self, dbapi_connection: Any) -> None:
        raise TransactionManagementError("the ledger never commits a Django transaction: atomic() does")

    def do_rollback(self, dbapi_connection: Any) -> None:
        return None

    def do_close(self, dbapi_connection: Any) -> None:
        return None

    def do_terminate(self, dbapi_connection: Any) -> None:
        return None

    def on_connect(self) -> None:
        # psycopg's dialect adds a notice handler per connect, psycopg2's registers its UUID loader:
        # every call "connects" anew, and Django's connection stays as Django configured it.
        return None

    def get_isolation_level(self, dbapi_connection: Any) -> Any:
        # The psycopg dialect rolls back an idle connection after asking (the first connect's
        # initialisation asks): here that would end a transaction that is Django's to end.
        return PGDialect.get_isolation_level(self, dbapi_connection)  # type: ignore[arg-type, no-untyped-call]


class LentPsycopgDialect(_Lent, PGDialect_psycopg):
    """SQLAlchemy's psycopg 3 dialect on a connection Django owns."""


class LentPsycopg2Dialect(_Lent, PGDialect_psycopg2):
    """SQLAlchemy's psycopg2 dialect on a connection Django owns."""


registry.register("postgresql.django_psycopg", __name__, "LentPsycopgDialect")
registry.register("postgresql.django_psycopg2", __name__, "LentPsycopg2Dialect")

_lent: ContextVar[Any] = ContextVar("producer.django: the Django connection lent to the ledger")
_engines: dict[tuple[str, str], Engine] = {}
_engines_lock = threading.Lock()

# What the ledger reads whose loading Django configures its own way: jsonb as text (Django's
# JSONField decodes it itself) and timestamptz in Django's time zone (naive with USE_TZ off).
_LEDGER_LOADS = ("json", "jsonb", "timestamptz")
# The same types and their arrays by PostgreSQL's fixed OIDs (psycopg2 keeps no names).
_LEDGER_OIDS = (114, 199, 3802, 3807, 1184, 1185)


@dataclass(frozen=True)
class Driver:
    """One of Django's PostgreSQL drivers: its module, its connection class, how a failed transaction
    shows, how its connection is made as the ledger expects, and the dialect it is lent through."""

    module: str
    connection: str  # the connection class's path in the module
    failed: Callable[[Any, Any], bool]  # (module, connection): a statement failed, only a rollback ends it
    fit: Callable[[Any, Any], AbstractContextManager[None]]  # (module, connection), for the call
    dialect: str

    def owns(self, raw: Any) -> bool:
        found = sys.modules.get(self.module)  # Django imported it if its connection is one
        if found is None:
            return False
        cls: Any = functools.reduce(getattr, self.connection.split("."), found)
        return isinstance(raw, cls)

    def in_error(self, raw: Any) -> bool:
        return self.failed(sys.modules[self.module], raw)

    @contextmanager
    def lent(self, using: str, raw: Any) -> Iterator[Engine]:
        """For the call, the engine whose every checkout is ``raw``, made as the ledger expects."""
        token = _lent.set(raw)
        try:
            with self.fit(sys.modules[self.module], raw):
                yield self._engine(using)
        finally:
            _lent.reset(token)

    def _engine(self, using: str) -> Engine:
        """One engine per Django database and driver. The dialect learns the server (version,
        settings) on its first connect, inside the caller's transaction, with read-only statements;
        hstore is left out (its lookup would register adapters on Django's connection, and the ledger
        has no hstore column)."""
        with _engines_lock:
            engine = _engines.get((using, self.dialect))
            if engine is None:
                engine = _engines[using, self.dialect] = create_engine(
                    f"postgresql+{self.dialect}://",
                    creator=_lent.get,
                    poolclass=NullPool,
                    pool_reset_on_return=None,
                    use_native_hstore=False,
                )
            return engine


@contextmanager
def _as_psycopg_makes_it(psycopg: Any, conn: Any) -> Iterator[None]:
    """For the call, the connection as psycopg makes it, as on the ledger's own engines: psycopg's
    loaders for what the ledger reads, and server-side binding (Django binds on the client by default).
    Django's settings come back afterwards. Where Django binds on the client (PgBouncer's transaction
    pooling needs that), no prepared statement is left on its connection either."""
    Format = psycopg.pq.Format
    swapped: list[tuple[int, Any, Any]] = []
    for name in _LEDGER_LOADS:
        oid = psycopg.adapters.types[name].oid
        for fmt in (Format.TEXT, Format.BINARY):
            django_loader, default = conn.adapters.get_loader(oid, fmt), psycopg.adapters.get_loader(oid, fmt)
            if django_loader is not None and default is not None and django_loader is not default:
                swapped.append((oid, fmt, django_loader))
                conn.adapters.register_loader(oid, default)
    cursor_factory, prepare_threshold = conn.cursor_factory, conn.prepare_threshold
    conn.cursor_factory = psycopg.Cursor
    if issubclass(cursor_factory, psycopg.ClientCursor):
        conn.prepare_threshold = None
    try:
        yield
    finally:
        conn.cursor_factory, conn.prepare_threshold = cursor_factory, prepare_threshold
        for oid, _fmt, loader in swapped:
            conn.adapters.register_loader(oid, loader)


@contextmanager
def _as_psycopg2_makes_it(psycopg2: Any, conn: Any) -> Iterator[None]:
    """For the call, psycopg2's own typecasters for what the ledger reads (Django registers jsonb as
    text on its connection; its cursors, not the connection, read times naive without USE_TZ) and
    psycopg2's plain cursor (OPTIONS may name another). Django's come back afterwards."""
    own = conn.string_types  # the connection's typecasters, over psycopg2's global ones
    swapped = {oid: own.pop(oid) for oid in _LEDGER_OIDS if oid in own}
    cursor_factory = conn.cursor_factory
    conn.cursor_factory = psycopg2.extensions.cursor
    try:
        yield
    finally:
        conn.cursor_factory = cursor_factory
        own.update(swapped)


def _psycopg_failed(psycopg: Any, conn: Any) -> bool:
    return bool(conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR)


def _psycopg2_failed(psycopg2: Any, conn: Any) -> bool:
    return bool(conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_INERROR)


DRIVERS = (
    Driver("psycopg", "Connection", _psycopg_failed, _as_psycopg_makes_it, "django_psycopg"),
    Driver("psycopg2", "extensions.connection", _psycopg2_failed, _as_psycopg2_makes_it, "django_psycopg2"),
)
