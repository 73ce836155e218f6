"""What agent runtimes call: submit intents into the outbox.

Inside your own transaction (the point of an outbox)::

    from producer import submit
    with Session.begin() as session:
        session.add(MyAgentStep(...))                      # your own rows
        receipt = submit(session, tenant="acme", idempotency_key="wf-81:invoice-17:refund-2:v1",
                         action="payments.refund.create",
                         args={"order_id": "o-17", "amount": "25.00", "currency": "EUR"},
                         subject="agent:support-bot")

Or let the outbox open the transaction: ``Outbox.from_settings().submit(...)``.
"""

from __future__ import annotations

from outbox.errors import IdempotencyConflict, InvalidIntent
from outbox.submit import Receipt, submit
from producer.client import Outbox

__all__ = ["Outbox", "Receipt", "submit", "IdempotencyConflict", "InvalidIntent"]
