"""Submit a refund from a plain Python script and wait for its outcome (the embedded default).

    agent-outbox sandbox --port 8900 &                                   # the provider (or your own)
    export OUTBOX_ACTIONS_FILE=examples/actions.yaml
    agent-outbox run &                                                   # relay + worker on ./.outbox/
    python examples/plain_script.py o-17 25.00

``Outbox.from_settings()`` reads the same ``OUTBOX_*`` variables as the workers (here none but the
actions file: a SQLite ledger in ``./.outbox/``), and opens its own transaction per submit. Inside a
transaction of your own, use ``producer.submit(session, ...)`` instead (docs/how-to/submit.md).
The idempotency key is the workflow's identity: running the script again for the
same order answers the same operation, and the provider refunds once.
"""

from __future__ import annotations

import sys

from outbox.service import operations, waiting
from producer import Outbox


def main(order_id: str = "o-17", amount: str = "25.00") -> int:
    outbox = Outbox.from_settings()
    try:
        receipt = outbox.submit(
            idempotency_key=f"refund:{order_id}:v1",  # the business identity, never per run or retry
            action="payments.refund.create",
            # Money as a decimal string: the action's decimal_args refuses numbers (25.00 would be 25).
            args={"order_id": order_id, "amount": amount, "currency": "EUR", "reason": "damaged"},
            subject="script:refunds",
        )
        print(f"operation {receipt.operation_id}: {receipt.status} (new: {receipt.new})")
        settled = waiting.wait(outbox.sessions, receipt.operation_id, timeout_s=60)
        with outbox.sessions() as session:
            op = operations.read(session, receipt.tenant, receipt.operation_id)
    finally:
        outbox.close()
    print(f"{op['status']}: {op['model_message']}")
    if not settled:
        return 2  # still pending: it goes on in the workers; run the script again to read it
    return 0 if op["outcome"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
