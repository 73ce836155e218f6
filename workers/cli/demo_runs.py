"""The demo's multi-step runs (outbox/runs/lifecycle.py), against the same faulty sandbox as its intents.

Three runs: a quote drafted, revised and committed (draft-then-commit); a purchase order (order,
stock held, the buyer told); and one whose last step the provider rejects, so its completed steps
are undone by their compensations, in reverse order. Each step's effect is counted by the sandbox.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.models import Run
from outbox.ledger.run_states import ACTIVE, RunStatus
from outbox.runs.lifecycle import run_json, submit_run
from outbox.runs.spec import StepRules
from workers.cli.pipeline import Pipeline


def _runs(key: str) -> list[tuple[str, list[dict[str, Any]]]]:
    def undo(step: str) -> dict[str, Any]:
        return {"action": "shop.cancel", "args": {"undoes": f"{key}-po:{step}"}}

    return [
        (
            f"{key}-quote",
            [
                {"name": "draft", "action": "quote.draft", "args": {"quote_ref": f"Q-{key}", "amount": "120.00"}},
                {"name": "revise", "action": "quote.draft", "args": {"quote_ref": f"Q-{key}", "amount": "110.00"}},
                {"name": "commit", "action": "quote.commit", "args": {"quote_ref": f"Q-{key}"}},
            ],
        ),
        (
            f"{key}-po",
            [
                {
                    "name": "order",
                    "action": "shop.order.create",
                    "args": {"order_ref": f"PO-{key}"},
                    "compensate": undo("order"),
                },
                {
                    "name": "reserve",
                    "action": "shop.stock.reserve",
                    "args": {"sku": "A-1", "qty": 2},
                    "compensate": undo("reserve"),
                },
                {
                    "name": "notify",
                    "action": "notify.email.send",
                    "args": {"to": "buyer@example.com", "subject": "Ordered"},
                },
            ],
        ),
        (
            f"{key}-refused",
            [
                {
                    "name": "order",
                    "action": "shop.order.create",
                    "args": {"order_ref": f"PO2-{key}"},
                    "compensate": undo("order2"),
                },
                # 0.00 is refused by the provider (422): the order above is then cancelled.
                {
                    "name": "refund",
                    "action": "payments.refund.create",
                    "args": {"order_id": f"PO2-{key}", "amount": "0.00", "currency": "EUR"},
                },
            ],
        ),
    ]


def play_runs(sessions: sessionmaker[Session], tenant: str, rules: StepRules | None) -> list[str]:
    ids = []
    for run_key, steps in _runs(tenant):
        with sessions.begin() as s:
            ids.append(
                submit_run(
                    s,
                    tenant=tenant,
                    run_key=run_key,
                    steps=steps,
                    subject="agent:buyer",
                    rules=rules,
                    budget={"max_attempts": 20},
                ).run_id
            )
    return ids


def wait_runs(
    console: Console, sessions: sessionmaker[Session], run_ids: list[str], timeout_s: float, pipeline: Pipeline
) -> int:
    """Wait until every run has ended (or the time is up); returns how many still move."""
    deadline = time.monotonic() + timeout_s
    with console.status("runs finishing...") as status:
        while True:
            with sessions() as s:
                moving = [
                    r for r in (s.get(Run, i) for i in run_ids) if r is not None and RunStatus(r.status) in ACTIVE
                ]
                status.update(
                    f"runs: {len(run_ids) - len(moving)}/{len(run_ids)} ended; "
                    + ", ".join(f"{r.run_key}: {r.reason}" for r in moving)[:150]
                )
            if not moving or time.monotonic() > deadline or not pipeline.alive():
                return len(moving)
            time.sleep(0.25)


def runs_table(
    console: Console, sessions: sessionmaker[Session], run_ids: list[str], effects: list[dict[str, Any]]
) -> None:
    per_key: dict[str, int] = {}
    for e in effects:
        per_key[e.get("idempotency_key") or ""] = per_key.get(e.get("idempotency_key") or "", 0) + 1
    table = Table(title="runs (each step's effects as the sandbox counted them)")
    for col in ("run", "status", "steps: state (effects)", "compensations (effects)", "attempts / retries"):
        table.add_column(col, overflow="fold")
    with sessions() as s:
        for run_id in run_ids:
            run = s.get(Run, run_id)
            if run is None:
                continue
            doc = run_json(s, run)
            steps, comps = [], []
            for step in doc["steps"]:
                op = step["operation"]
                n = per_key.get(op["provider_key"], 0) if op else 0
                steps.append(f"{step['name']}: {step['state']} ({n})")
                comp = step["compensation"]
                if comp and comp["operation"]:
                    c = comp["operation"]
                    comps.append(f"{step['name']}: {c['status']} ({per_key.get(c['provider_key'], 0)})")
            b = doc["budget"]
            table.add_row(
                doc["run_key"],
                doc["status"],
                "\n".join(steps),
                "\n".join(comps) or "-",
                f"{b['used']} / {b['retries']}",
            )
    console.print(table)
