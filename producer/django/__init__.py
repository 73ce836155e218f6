"""Submit from a Django application, in its own transaction (extra ``[django]``)::

    from django.db import transaction
    from producer import django as outbox

    with transaction.atomic():
        refund = RefundRequest.objects.create(order_id="o-17", amount=Decimal("25.00"))
        receipt = outbox.submit(tenant="acme", idempotency_key="refund:o-17:v1",
                                action="payments.refund.create",
                                args={"order_id": "o-17", "amount": str(refund.amount), "currency": "EUR"},
                                subject="django:refunds")

``submit`` and ``submit_run`` take the keyword arguments of ``producer.submit`` / ``producer.submit_run``
(without the session) and ``using`` (the Django database alias). The very same ledger code runs, on
Django's own connection: for the length of the call that connection is lent to a SQLAlchemy session
whose dialect never commits, rolls back or closes it. Django's ``atomic()`` commits the intent with
the application's rows, or rolls both back (an inner ``atomic()`` too: its savepoint takes the intent
with it); PostgreSQL delivers the relay's NOTIFY on that commit only.

Money goes as a decimal string (``str(refund.amount)``): an action with ``decimal_args`` refuses numbers.

Supported: PostgreSQL (``django.db.backends.postgresql``) on either of Django's drivers, psycopg 3 or
psycopg2 (which Django 4.2+ uses when psycopg 3 has no implementation installed); producer/django/lent.py
lends each. Other Django databases are refused with what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, Unpack, overload

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.transaction import TransactionManagementError
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox.errors import ConfigError, OutboxError
from outbox.ledger.intent import Intent
from outbox.ledger.key_uses import IN_CALLERS_TRANSACTION
from outbox.ledger.provider_keys import SubmitRules
from outbox.ledger.submit import Receipt
from outbox.ledger.submit import submit as ledger_submit
from outbox.runs.lifecycle import RunReceipt
from producer.django.lent import DRIVERS
from producer.keywords import IntentFields, as_intent, former_rules
from producer.keywords import submit_run as ledger_submit_run

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
    """The Django database is not PostgreSQL on psycopg 3 or psycopg2; the message says what to change."""


@overload
def submit(intent: Intent, /, *, using: str = DEFAULT_DB_ALIAS, rules: SubmitRules | None = None) -> Receipt: ...


@overload
def submit(
    *, using: str = DEFAULT_DB_ALIAS, tenant: str, rules: SubmitRules | None = None, **fields: Unpack[IntentFields]
) -> Receipt: ...


def submit(
    intent: Intent | None = None,
    /,
    *,
    using: str = DEFAULT_DB_ALIAS,
    tenant: str | None = None,
    rules: SubmitRules | None = None,
    **fields: Any,
) -> Receipt:
    """``producer.submit`` in Django's transaction on ``using`` (inside ``transaction.atomic()``).
    Same arguments (an ``Intent``, or tenant, idempotency_key, action, args, subject, ... as keywords;
    rules), same receipt, same errors (``IdempotencyConflict``, ``InvalidIntent``); never commits."""
    rules = former_rules(rules, fields)
    built = as_intent(intent, tenant, fields)
    return _in_django_transaction(using, lambda session: ledger_submit(session, built, rules=rules))


def submit_run(*, using: str = DEFAULT_DB_ALIAS, **run: Any) -> RunReceipt:
    """``producer.submit_run`` in Django's transaction on ``using`` (inside ``transaction.atomic()``)."""
    return _in_django_transaction(using, lambda session: ledger_submit_run(session, **run))


def _in_django_transaction(using: str, write: Callable[[Session], T]) -> T:
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise UnsupportedDatabase(
            f"producer.django submits on PostgreSQL only (django.db.backends.postgresql); "
            f"the Django database {using!r} is {connection.vendor}. Point it at the PostgreSQL database "
            "the outbox was migrated into (agent-outbox migrate), or use producer.Outbox on a ledger of its own"
        )
    # AUTOCOMMIT off (the application runs its own transactions) is a transaction too.
    if not connection.in_atomic_block and connection.get_autocommit():
        raise OutsideAtomicBlock(using)
    connection.validate_no_broken_transaction()  # Django's own refusal after an error in the block
    connection.ensure_connection()
    raw = connection.connection
    driver = next((d for d in DRIVERS if d.owns(raw)), None)
    if driver is None:
        raise UnsupportedDatabase(
            f"producer.django needs Django on psycopg 3 or psycopg2; the Django database {using!r} runs on "
            f"{type(raw).__module__}. Use django.db.backends.postgresql (or a backend built on it)"
        )
    # The transaction is Django's: what the ledger counts on the side is counted in it (key_uses.py).
    with driver.lent(using, raw) as engine, Session(engine, info={IN_CALLERS_TRANSACTION: True}) as session:
        try:
            # A failed statement reaches the caller as Django's own error (django.db.IntegrityError,
            # ...), whichever path the statement took: the driver's error straight from the raw
            # psycopg 3 path, or the one SQLAlchemy wrapped on the text() path.
            with connection.wrap_database_errors:
                try:
                    result = write(session)
                    session.flush()  # a run's rows are ORM objects: written now, committed by atomic()
                except DBAPIError as exc:
                    if exc.orig is None:
                        raise
                    raise exc.orig from exc
        except BaseException:
            if driver.in_error(raw) and connection.in_atomic_block:
                # A failed statement: the block must roll back (its savepoint, or the whole
                # transaction), as Django does after an error of its own.
                transaction.set_rollback(True, using=using)
            raise
    return result
