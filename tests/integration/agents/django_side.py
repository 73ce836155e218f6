"""The Django side of tests/integration/agents/test_django.py, run in a process of its own: Django's settings
and app registry are global to a process, and must not leak into the test process's other tests.

``python tests/integration/agents/django_side.py SCENARIO JSON`` runs one scenario with the JSON object as
its keyword arguments and prints what happened as one JSON line (with ``django_driver``, the module of
Django's connection). Environment: the example project on PYTHONPATH (examples/django_app),
DJANGO_SETTINGS_MODULE=refunds_site.settings, OUTBOX_DATABASE_URL; DJANGO_SIDE_DRIVER=psycopg2 runs
Django as where psycopg has no implementation: ``import psycopg`` fails, and Django takes psycopg2.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from decimal import Decimal
from typing import Any

if os.environ.get("DJANGO_SIDE_DRIVER") == "psycopg2":
    sys.modules["psycopg"] = None  # type: ignore[assignment]  # importing it raises ImportError

import django

django.setup()

from django.db import DatabaseError, connection, transaction  # noqa: E402 - after setup()
from django.db.transaction import TransactionManagementError  # noqa: E402
from django.test import Client  # noqa: E402
from refunds.models import RefundRequest  # noqa: E402

from producer import IdempotencyConflict  # noqa: E402
from producer import django as outbox  # noqa: E402

SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {}
INTENT = {"tenant": "t1", "action": "payments.refund.create", "subject": "django:test"}


def scenario(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


class Boom(Exception):
    pass


def refund_args(order: str, amount: str = "12.50") -> dict[str, Any]:
    return {"order_id": order, "amount": amount, "currency": "EUR", "reason": "damaged"}


def add_row(key: str, order: str) -> RefundRequest:
    return RefundRequest.objects.create(idempotency_key=key, order_id=order, amount=Decimal("12.50"), currency="EUR")


def connection_state() -> dict[str, Any]:
    """What Django configured on its connection that the call borrows and must give back."""
    raw = connection.connection
    if type(raw).__module__.startswith("psycopg2"):
        import psycopg2.extensions as ext

        status = {getattr(ext, f"TRANSACTION_STATUS_{n}"): n for n in ("IDLE", "ACTIVE", "INTRANS", "INERROR")}
        return {
            "cursor_factory": raw.cursor_factory.__name__,
            "typecasters": {oid: caster.name for oid, caster in raw.string_types.items()},
            "transaction_status": status[raw.get_transaction_status()],
            "in_atomic_block": connection.in_atomic_block,
        }
    import psycopg

    types, text = psycopg.adapters.types, psycopg.pq.Format.TEXT
    return {
        "cursor_factory": raw.cursor_factory.__name__,
        "jsonb_loader": raw.adapters.get_loader(types["jsonb"].oid, text).__name__,
        "timestamptz_loader": raw.adapters.get_loader(types["timestamptz"].oid, text).__name__,
        "prepare_threshold": raw.prepare_threshold,
        "transaction_status": raw.info.transaction_status.name,
        "in_atomic_block": connection.in_atomic_block,
    }


@scenario
def views(requests: list[list[Any]]) -> dict[str, Any]:
    """The example's views through Django's test client (the real URLconf, views, model)."""
    client = Client(raise_request_exception=False)
    answers = []
    for path, body in requests:
        r = client.post(path, data=json.dumps(body), content_type="application/json")
        answers.append({"status": r.status_code, "body": r.json()})
    return {"answers": answers}


@scenario
def first_submit_after_a_write(order: str) -> dict[str, Any]:
    """The process's first submit (SQLAlchemy meets Django's connection for the first time) in a
    transaction that already wrote a row: the row and the transaction survive it; both commit."""
    with transaction.atomic():
        row = add_row(f"{order}:row", order)
        before = connection_state()
        receipt = outbox.submit(idempotency_key=f"{order}:op", args=refund_args(order), **INTENT)
        after = connection_state()
        still_there = RefundRequest.objects.filter(pk=row.pk).exists()
    return {"operation_id": receipt.operation_id, "before": before, "after": after, "row_visible": still_there}


@scenario
def first_submit_then_rollback(order: str) -> dict[str, Any]:
    """The process's first submit as the transaction's first statement, then a row, then a failure:
    nothing of it may stay (SQLAlchemy's initialisation ends and commits nothing)."""
    try:
        with transaction.atomic():
            receipt = outbox.submit(idempotency_key=f"{order}:op", args=refund_args(order), **INTENT)
            add_row(f"{order}:row", order)
            raise Boom(receipt.operation_id)
    except Boom as boom:
        return {"operation_id": boom.args[0]}
    raise AssertionError("the block did not fail")


@scenario
def inner_atomic_rolled_back(order: str) -> dict[str, Any]:
    with transaction.atomic():
        add_row(f"{order}:row", order)
        kept = outbox.submit(idempotency_key=f"{order}:kept", args=refund_args(order), **INTENT)
        try:
            with transaction.atomic():  # a savepoint
                dropped = outbox.submit(idempotency_key=f"{order}:dropped", args=refund_args(order), **INTENT)
                add_row(f"{order}:dropped-row", order)
                raise Boom(dropped.operation_id)
        except Boom as boom:
            dropped_id = boom.args[0]
    return {"kept": kept.operation_id, "dropped": dropped_id}


@scenario
def outside_atomic(order: str) -> dict[str, Any]:
    try:
        outbox.submit(idempotency_key=f"{order}:outside", args=refund_args(order), **INTENT)
    except outbox.OutsideAtomicBlock as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "django_kind": isinstance(exc, TransactionManagementError),
        }
    return {"error": None}


@scenario
def replay_and_conflict(order: str) -> dict[str, Any]:
    key = f"{order}:replayed"
    with transaction.atomic():
        first = outbox.submit(idempotency_key=key, args=refund_args(order), **INTENT)
    with transaction.atomic():
        again = outbox.submit(idempotency_key=key, args=refund_args(order), **INTENT)
    with transaction.atomic():
        try:
            outbox.submit(idempotency_key=key, args=refund_args(order, amount="99.00"), **INTENT)
            conflict = None
        except IdempotencyConflict as exc:
            conflict = {"operation_id": exc.operation_id, "message": str(exc)}
        # A conflict is no database error: the caller's transaction goes on and commits.
        add_row(f"{order}:after-conflict", order)
    return {"first": first.as_dict(), "again": again.as_dict(), "conflict": conflict}


@scenario
def approval_and_run(order: str) -> dict[str, Any]:
    """An intent that waits for a person (no NOTIFY: nothing is due), and a run of two steps."""
    with transaction.atomic():
        waiting = outbox.submit(
            idempotency_key=f"{order}:approval", args=refund_args(order), requires_approval=True, **INTENT
        )
        run = outbox.submit_run(
            tenant="t1",
            run_key=f"{order}:run",
            subject="django:test",
            steps=[
                {"name": "refund", "action": "payments.refund.create", "args": refund_args(order)},
                {
                    "name": "ticket",
                    "action": "support.ticket.create",
                    "args": {"subject": f"refunded {order}", "customer_id": "c-1"},
                },
            ],
        )
    return {"waiting": waiting.as_dict(), "run": run.as_dict()}


@scenario
def database_error_in_the_block(order: str) -> dict[str, Any]:
    """The ledger's statement fails (a read-only transaction refuses the insert) and the caller
    catches it inside the block: Django is told, as after an error of its own, so the block refuses
    further queries and rolls back; nothing of it commits."""
    with transaction.atomic():
        add_row(f"{order}:row", order)
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION READ ONLY")
        try:
            outbox.submit(idempotency_key=f"{order}:op", args=refund_args(order), **INTENT)
            error = None
        except DatabaseError as exc:  # Django's own, around the driver's (either path)
            error = type(exc.__cause__).__name__
        except Exception as exc:  # noqa: BLE001 - the scenario reports what it was
            error = f"not Django's: {type(exc).__module__}.{type(exc).__name__}"
        needs_rollback = connection.needs_rollback
        try:
            add_row(f"{order}:after", order)
            after = "written"
        except TransactionManagementError:
            after = "refused by Django"
    return {"error": error, "needs_rollback": needs_rollback, "after": after}


@scenario
def run_with_a_deadline(order: str) -> dict[str, Any]:
    """A run whose deadline the ledger computes from the database's clock, as it reads it."""
    with transaction.atomic():
        run = outbox.submit_run(
            tenant="t1",
            run_key=f"{order}:run",
            subject="django:test",
            steps=[{"name": "refund", "action": "payments.refund.create", "args": refund_args(order)}],
            budget={"deadline_s": 3600},
        )
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            django_now = cursor.fetchone()[0]
        loader = connection_state().get("timestamptz_loader")
    return {"run": run.as_dict(), "django_timestamptz_loader": loader, "django_reads_naive": django_now.tzinfo is None}


@scenario
def not_postgresql(order: str) -> dict[str, Any]:
    with transaction.atomic():
        try:
            outbox.submit(idempotency_key=f"{order}:sqlite", args=refund_args(order), **INTENT)
        except outbox.UnsupportedDatabase as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


if __name__ == "__main__":
    connection.ensure_connection()
    driver = type(connection.connection).__module__.split(".")[0]  # before a request closes it
    result = SCENARIOS[sys.argv[1]](**json.loads(sys.argv[2]))
    print(json.dumps(result | {"django_driver": driver}, default=str))
