"""What agent runtimes call: submit intents into the outbox.

Inside your own transaction (the point of an outbox)::

    from producer import submit
    with Session.begin() as session:
        session.add(MyAgentStep(...))                      # your own rows
        receipt = submit(session, tenant="acme", idempotency_key="wf-81:invoice-17:refund-2:v1",
                         action="payments.refund.create",
                         args={"order_id": "o-17", "amount": "25.00", "currency": "EUR"},
                         subject="agent:support-bot")

The keywords are the fields of ``Intent`` (outbox/ledger/intent.py), the value the ledger takes; an
``Intent`` built beforehand goes in their place: ``submit(session, intent)``. Building one validates
it: a bad field raises ``InvalidIntent`` naming the field, before anything is written.

A multi-step run (steps in order, each ``{run_key}:{name}``, compensations in reverse on failure)::

    receipt = submit_run(session, tenant="acme", run_key="po-81", subject="agent:buyer",
                         steps=[{"name": "order", "action": "shop.order.create", "args": {...},
                                 "compensate": {"action": "shop.order.cancel", "args": {...}}},
                                {"name": "notify", "action": "notify.email.send", "args": {...}}],
                         budget={"max_attempts": 8, "deadline_s": 600})

Or let the outbox open the transaction: ``Outbox.from_settings().submit(...)`` / ``.submit_run(...)``.

From asyncio (SQLAlchemy ``AsyncSession`` on asyncpg or psycopg's async connection), the same in your
``async with session.begin():`` as ``await submit_async(session, ...)`` / ``submit_run_async``, or
``await AsyncOutbox.from_settings().submit(...)`` (producer/aio.py).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from outbox.errors import IdempotencyConflict, InvalidIntent, RunConflict
from outbox.ledger.intent import Intent
from outbox.ledger.submit import Receipt
from outbox.runs.lifecycle import RunReceipt
from producer.client import Outbox
from producer.keywords import submit, submit_run

if TYPE_CHECKING:
    from producer.aio import AsyncOutbox, submit_async, submit_run_async

__all__ = [
    "Intent",
    "Outbox",
    "Receipt",
    "RunReceipt",
    "submit",
    "submit_run",
    "IdempotencyConflict",
    "InvalidIntent",
    "RunConflict",
]
# The async names only where they import (extra [asyncio]): ``from producer import *`` must work on
# the core install too.
if importlib.util.find_spec("greenlet") is not None:
    __all__ += ["AsyncOutbox", "submit_async", "submit_run_async"]
# OpenTelemetry installed (extra [otel]): a submit continues the caller's current trace and stores it
# (producer/tracing.py). Without it nothing is imported and submit stores only an explicit traceparent.
if importlib.util.find_spec("opentelemetry") is not None and importlib.util.find_spec("opentelemetry.trace"):
    from producer import tracing as _tracing

    _tracing.install()


def __getattr__(name: str) -> Any:
    # The async names load SQLAlchemy's asyncio extension, which needs greenlet (extra [asyncio]):
    # imported when first asked for, so the core install imports ``producer`` without it.
    if name in ("AsyncOutbox", "submit_async", "submit_run_async"):
        from producer import aio

        return getattr(aio, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
