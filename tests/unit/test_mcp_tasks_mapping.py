"""MCP Tasks: every operation status maps to one task status (producer/agents/mcp_tasks.py), an
approval to the console's page (never a form), unknown and with-a-person to `working` saying which."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest

pytest.importorskip("mcp")
from outbox.ledger.states import Status  # noqa: E402
from producer.agents.mcp_tasks import ELICITATION_META, task_of  # noqa: E402

NOW = dt.datetime(2026, 12, 3, 7, 0, tzinfo=dt.UTC)
EXPECTED = {
    Status.AWAITING_APPROVAL: "input_required",
    Status.NOT_DISPATCHED: "working",
    Status.DISPATCHING: "working",
    Status.OUTCOME_UNKNOWN: "working",
    Status.RECONCILIATION_REQUIRED: "working",
    Status.ACCEPTED: "working",
    Status.SUCCEEDED: "completed",
    Status.COMMITTED_EVIDENCE_DEGRADED: "completed",
    Status.FAILED_BEFORE_COMMIT: "completed",  # isError in tasks/result: a business outcome
    Status.FAILED_AT_PROVIDER: "completed",
    Status.CANCELLED: "cancelled",
    Status.ABANDONED: "completed",  # a person closed it without knowing: the result says so
}


def _op(status: Status) -> SimpleNamespace:
    return SimpleNamespace(
        id="op-1", action="payments.refund.create", status=status.value, created_at=NOW, updated_at=NOW
    )


def test_every_status_has_its_task_status():
    assert set(EXPECTED) == set(Status)
    for status, expected in EXPECTED.items():
        task = task_of(_op(status), "https://outbox.example/")
        assert task["status"] == expected, status
        assert task["taskId"] == "op-1" and task["ttl"] is None and task["createdAt"] == NOW.isoformat()


def test_messages_say_which_and_approval_is_a_url():
    assert task_of(_op(Status.OUTCOME_UNKNOWN), "")["statusMessage"] == "outcome unknown: asking the provider"
    assert task_of(_op(Status.RECONCILIATION_REQUIRED), "")["statusMessage"].startswith("with a person")
    asked = task_of(_op(Status.AWAITING_APPROVAL), "https://outbox.example/")["_meta"][ELICITATION_META]
    assert asked == {
        "mode": "url",
        "message": "Approve or deny payments.refund.create in the agent-outbox console.",
        "url": "https://outbox.example/console/approvals#op-op-1",
        "elicitationId": "op-1",
    }
