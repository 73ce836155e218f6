"""What the agent examples share: the outbox running offline on one machine.

The sandbox provider (a real HTTP server in this process), the embedded ledger (SQLite in a temporary
folder) and its pipeline (the relay in a thread, one Celery worker process on the SQLite broker), with
an actions file that makes refunds an action. Nothing here is needed in production: there the ledger,
broker and workers are yours (docs/how-to/deploy.md).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from outbox.actions.rules import load_action_rules
from producer.agents.calls import ToolCaller
from producer.client import Outbox

REFUND = "payments.refund.create"


def refund_action(base_url: str, *, approval: dict[str, Any] | None = None) -> dict[str, Any]:
    path = "/v1/refunds"
    action: dict[str, Any] = {
        "target": "sandbox",
        "request": {"method": "POST", "path": path},
        "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
        "lookup": {
            "request": {"method": "GET", "path": path, "query": {"idempotency_key": "{idempotency_key}"}},
            "authoritative_not_found": True,
            "settle_s": 0.5,
            "succeeded": ["succeeded"],
        },
        "args": ["order_id", "amount", "currency", "reason"],
        "decimal_args": ["amount"],
        "tool": {"description": "Refund (part of) an order to the customer.", "reference_args": ["order_id"]},
        "budget": {"max_attempts": 4, "deadline_s": 120, "base_delay_s": 0.1, "max_delay_s": 1},
    }
    if approval:
        action["approval"] = approval
    return action


@contextmanager
def offline(*, approval: dict[str, Any] | None = None, tenant: str = "demo") -> Iterator[tuple[ToolCaller, Any]]:
    """(a ToolCaller for ``tenant``, the sandbox). Uses the OUTBOX_* settings already in the
    environment when OUTBOX_ACTIONS_FILE is set (the tests' PostgreSQL pipeline); otherwise starts
    everything here, offline."""
    from outbox.settings import load_settings
    from workers.cli.ledger import open_engine

    if os.environ.get("OUTBOX_ACTIONS_FILE"):
        settings = load_settings()
        rules = load_action_rules(settings.actions_file)  # type: ignore[arg-type]
        outbox = Outbox(open_engine(settings), rules=rules)
        try:
            yield (
                ToolCaller(outbox, rules, tenant=os.environ.get("EXAMPLE_TENANT", "t1"), subject="agent:example"),
                None,
            )
        finally:
            outbox.close()
        return

    from workers.cli.pipeline import Pipeline
    from workers.sandbox.testing import SandboxServer

    with SandboxServer(seed=1) as sandbox, tempfile.TemporaryDirectory() as tmp:
        doc = {
            "targets": {"sandbox": {"base_url": sandbox.url, "timeout_s": 2, "connect_timeout_s": 1}},
            "actions": {REFUND: refund_action(sandbox.url, approval=approval)},
        }
        actions = Path(tmp) / "actions.yaml"
        actions.write_text(yaml.safe_dump(doc, sort_keys=False))
        os.environ.update({"OUTBOX_DATA_DIR": str(Path(tmp) / "data"), "OUTBOX_ACTIONS_FILE": str(actions)})
        settings = load_settings()
        rules = load_action_rules(actions)
        outbox = Outbox(open_engine(settings), rules=rules)
        pipeline = Pipeline(settings, worker_output=os.open(os.devnull, os.O_WRONLY))
        pipeline.start()
        try:
            yield ToolCaller(outbox, rules, tenant=tenant, subject="agent:example"), sandbox
        finally:
            pipeline.stop()
            outbox.close()
            del os.environ["OUTBOX_ACTIONS_FILE"]
