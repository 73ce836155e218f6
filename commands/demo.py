"""``agent-outbox demo``: show the outbox on the embedded default, with no server.

For now (ledger only) it plays an agent runtime: submits intents in its own transactions, resubmits
one with the same key (same operation back), tries a changed-argument resubmit (refused as an
idempotency conflict) and lists what the ledger holds. The pipeline demo comes with the workers.
"""

from __future__ import annotations

import argparse
import uuid
from decimal import Decimal

from rich.console import Console
from rich.table import Table

from commands.ledger import open_engine
from outbox.db import make_sessionmaker
from outbox.errors import IdempotencyConflict
from outbox.queries import count_by_status
from outbox.settings import load_settings
from outbox.submit import submit


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="a short tour on the embedded default (no servers needed)")
    p.add_argument("--intents", type=int, default=5, help="how many refund intents to submit")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    settings = load_settings()
    engine = open_engine(settings)
    sessions = make_sessionmaker(engine)
    run = uuid.uuid4().hex[:8]
    console.print(f"ledger: {engine.url.render_as_string(hide_password=True)}  (demo run {run})")
    table = Table(title="what the agent runtime got back")
    for col in ("idempotency key", "operation_id", "new?", "status"):
        table.add_column(col)
    try:
        for i in range(1, args.intents + 1):
            with sessions.begin() as session:
                r = submit(session, tenant="demo", idempotency_key=f"demo-{run}:order-{i}:refund-1:v1",
                           action="payments.refund.create",
                           args={"order_id": f"order-{i}", "amount": Decimal(f"{10 * i}.50"), "currency": "EUR"},
                           subject="agent:support-bot", run_id=f"run-{run}")
            table.add_row(r.idempotency_key, r.operation_id, "yes" if r.new else "no (same intent)", r.status)
        # The model calls the same tool twice: same key, same arguments -> the same operation.
        with sessions.begin() as session:
            r = submit(session, tenant="demo", idempotency_key=f"demo-{run}:order-1:refund-1:v1",
                       action="payments.refund.create",
                       args={"currency": "EUR", "amount": "10.50", "order_id": "order-1"} | {"amount": Decimal("10.5")},
                       subject="agent:support-bot", run_id=f"run-{run}")
        table.add_row(r.idempotency_key, r.operation_id, "yes" if r.new else "no (same intent)", r.status)
        console.print(table)
        # Same key, different amount: refused, never silently replayed.
        try:
            with sessions.begin() as session:
                submit(session, tenant="demo", idempotency_key=f"demo-{run}:order-1:refund-1:v1",
                       action="payments.refund.create",
                       args={"order_id": "order-1", "amount": "99.00", "currency": "EUR"},
                       subject="agent:support-bot")
        except IdempotencyConflict as exc:
            console.print(f"[yellow]refused[/]: {exc}")
        with sessions() as session:
            counts = count_by_status(session)
        console.print("ledger now holds: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        console.print("explain one: agent-outbox ops show " + f"demo-{run}:order-1:refund-1:v1")
    finally:
        engine.dispose()
    return 0
