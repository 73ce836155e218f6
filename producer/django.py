"""Submit from a Django application, in its own transaction (extra ``[django]``)::

    from django.db import transaction
    from producer import django as outbox

    with transaction.atomic():
        refund = RefundRequest.objects.create(order_id="o-17", amount=Decimal("25.00"))
        receipt = outbox.submit(tenant="acme", idempotency_key="refund:o-17:v1",
                                action="payments.refund.create",
                                args={"order_id": "o-17", "amount": refund.amount, "currency": "EUR"},
                                subject="django:refunds")

``submit`` and ``submit_run`` take the keyword arguments of ``producer.submit`` / ``producer.submit_run``
(without the session) and ``using`` (the Django database alias). The very same ledger code runs, on
Django's own connection: for the length of the call that connection is lent to a SQLAlchemy session
whose dialect never commits, rolls back or closes it. Django's ``atomic()`` commits the intent with
the application's rows, or rolls both back (an inner ``atomic()`` too: its savepoint takes the intent
with it); PostgreSQL delivers the relay's NOTIFY on that commit only.

Supported: PostgreSQL through psycopg 3 (``django.db.backends.postgresql``; Django 4.2+ uses psycopg 3
whenever it is installed). Other Django databases, and psycopg2, are refused with what to change.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.transaction import TransactionManagementError
from sqlalchemy import Engine, create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.base import PGDialect
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox.errors import ConfigError, OutboxError
from outbox.ledger.submit import Receipt
from outbox.ledger.submit import submit as ledger_submit
from outbox.runs.lifecycle import RunReceipt
from outbox.runs.lifecycle import submit_run as ledger_submit_run

__all__ = ["OutsideAtomicBlock", "UnsupportedDatabase", "submit", "submit_run"]

T = TypeVar("T")


# Django ships no type hints: its exception classes are Any to mypy.
class OutsideAtomicBlock(OutboxError, TransactionManagementError):  # type: ignore[misc]
    """Django's connection was in autocommit mode: the intent would commit on its own, never roll
    back with the application's rows. Nothing was written."""

    def __init__(self, using: str) -> None:
        super().__init__(
            f"producer.django submits in the caller's transaction, and the Django database {using!r} has "
            f"none open: call it inside `with transaction.atomic(using={using!r}):` (or a view under "
            "ATOMIC_REQUESTS), so that the intent commits or rolls back with your rows"
        )
        self.using = using


class UnsupportedDatabase(ConfigError, ImproperlyConfigured):  # type: ignore[misc]
    """The Django database is not PostgreSQL on psycopg 3; the message says what to change."""


class LentPsycopgDialect(PGDialect_psycopg):
    """SQLAlchemy's psycopg dialect on a connection Django owns, lent for one call.

    The transaction is Django's: nothing here begins, commits, rolls back or closes it. The session's
    end "rolls back" (SQLAlchemy's habit when a session closes uncommitted) into nothing, and
    ``atomic()`` decides. A commit asked of it is a bug in the ledger, refused rather than obeyed.
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
        # psycopg's dialect adds a notice handler per connect: here every call "connects" anew, and
        # the handlers would pile up on Django's connection.
        return None

    def get_isolation_level(self, dbapi_connection: Any) -> Any:
        # The psycopg dialect rolls back an idle connection after asking (the first connect's
        # initialisation asks): here that would end a transaction that is Django's to end.
        return PGDialect.get_isolation_level(self, dbapi_connection)  # type: ignore[no-untyped-call]


registry.register("postgresql.django_psycopg", __name__, "LentPsycopgDialect")

_lent: ContextVar[Any] = ContextVar("producer.django: the Django connection lent to the ledger")
_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def _lent_connection() -> Any:
    return _lent.get()


def _engine(using: str) -> Engine:
    """One engine per Django database, whose every checkout is the connection lent for this call.

    The dialect learns the server (version, settings) on its first connect, inside the caller's
    transaction, with read-only statements; hstore is left out (its lookup would register adapters
    on Django's connection, and the ledger has no hstore column).
    """
    with _engines_lock:
        engine = _engines.get(using)
        if engine is None:
            engine = _engines[using] = create_engine(
                "postgresql+django_psycopg://",
                creator=_lent_connection,
                poolclass=NullPool,
                pool_reset_on_return=None,
                use_native_hstore=False,
            )
        return engine


def submit(*, using: str = DEFAULT_DB_ALIAS, **intent: Any) -> Receipt:
    """``producer.submit`` in Django's transaction on ``using`` (inside ``transaction.atomic()``).
    Same keyword arguments (tenant, idempotency_key, action, args, subject, key_rules, ...), same
    receipt, same errors (``IdempotencyConflict``, ``InvalidIntent``); never commits."""
    return _in_django_transaction(using, lambda session: ledger_submit(session, **intent))


def submit_run(*, using: str = DEFAULT_DB_ALIAS, **run: Any) -> RunReceipt:
    """``producer.submit_run`` in Django's transaction on ``using`` (inside ``transaction.atomic()``)."""
    return _in_django_transaction(using, lambda session: ledger_submit_run(session, **run))


def _in_django_transaction(using: str, write: Callable[[Session], T]) -> T:
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise UnsupportedDatabase(
            f"producer.django submits on PostgreSQL only (django.db.backends.postgresql with psycopg 3); "
            f"the Django database {using!r} is {connection.vendor}. Point it at the PostgreSQL database "
            "the outbox was migrated into (agent-outbox migrate), or use producer.Outbox on a ledger of its own"
        )
    # AUTOCOMMIT off (the application runs its own transactions) is a transaction too.
    if not connection.in_atomic_block and connection.get_autocommit():
        raise OutsideAtomicBlock(using)
    connection.validate_no_broken_transaction()  # Django's own refusal after an error in the block
    connection.ensure_connection()
    raw = connection.connection
    psycopg = sys.modules.get("psycopg")
    if psycopg is None or not isinstance(raw, psycopg.Connection):
        raise UnsupportedDatabase(
            f"producer.django needs Django on psycopg 3; the Django database {using!r} runs on "
            f"{type(raw).__module__}. Install psycopg 3 with an implementation (pip install "
            "'psycopg[binary]', or 'psycopg[c]'): Django 4.2+ then uses it instead of psycopg2"
        )
    engine = _engine(using)
    token = _lent.set(raw)
    try:
        with _as_the_ledger_expects(psycopg, raw), Session(engine) as session:
            try:
                result = write(session)
                session.flush()  # a run's rows are ORM objects: written now, committed by atomic()
            except BaseException:
                failed = raw.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
                if failed and connection.in_atomic_block:
                    # A failed statement: the block must roll back (its savepoint, or the whole
                    # transaction), as Django does after an error of its own.
                    transaction.set_rollback(True, using=using)
                raise
        return result
    finally:
        _lent.reset(token)


# What the ledger reads whose loading Django configures its own way: jsonb as text (Django's
# JSONField decodes it itself) and timestamptz in Django's time zone (naive with USE_TZ off).
_LEDGER_LOADS = ("json", "jsonb", "timestamptz")


@contextmanager
def _as_the_ledger_expects(psycopg: Any, conn: Any) -> Iterator[None]:
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
