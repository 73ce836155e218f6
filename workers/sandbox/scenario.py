"""The actions document that points agent-outbox at the sandbox: what the demo runs and what the
tests run, one copy (tests/harness.py re-exports it).

Every sandbox resource is created by POST and looked up by GET with ``?idempotency_key=``; the
statuses its objects take are the lookup's vocabulary below. Pure data: no import of ours.
"""

from __future__ import annotations

from typing import Any

# The seeded fault mix of the demo and of the test kit (workers/testkit/): what a careless provider
# does to a share of the creating requests (POST), before it commits (503 and 429 with Retry-After,
# a dropped connection) or after (the answer lost to a reset, a 502, a truncated body).
FAULT_MIX: list[dict[str, Any]] = [
    {"mode": "unavailable_503", "method": "POST", "probability": 0.06, "retry_after_s": 1},
    {
        "mode": "rate_limited_429",
        "method": "POST",
        "probability": 0.06,
        "retry_after_s": 1,
        "retry_after_http_date": True,
    },
    {"mode": "commit_then_drop", "method": "POST", "probability": 0.03},
    {"mode": "commit_then_502", "method": "POST", "probability": 0.03},
    {"mode": "truncated_body", "method": "POST", "probability": 0.02},
    {"mode": "drop_before_commit", "method": "POST", "probability": 0.02},
]

# What a looked-up sandbox object's status means (workers/sandbox/resources.py sets them).
SUCCEEDED = ["succeeded", "open", "sent", "placed", "held", "draft", "committed", "done"]


def action(path: str, *, settle_s: float = 0.5, **over: Any) -> dict[str, Any]:
    """One action on the sandbox's ``path`` (``/v1/refunds``...). ``settle_s``: how long after the
    last attempt a "not found" proves nothing was created (the sandbox's index lag, if any, must be
    shorter). ``over``: any other key of the action, replacing the default."""
    doc: dict[str, Any] = {
        "target": "sandbox",
        "request": {"method": "POST", "path": path},
        "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
        "fencing_header": "X-Fencing-Token",
        "lookup": {
            "request": {"method": "GET", "path": path, "query": {"idempotency_key": "{idempotency_key}"}},
            "authoritative_not_found": True,
            "settle_s": settle_s,
            "succeeded": list(SUCCEEDED),
            "pending": ["pending"],
            "failed": ["failed"],
        },
        "result_reference": "id",
        "budget": {"max_attempts": 4, "deadline_s": 120, "base_delay_s": 0.1, "max_delay_s": 1},
    }
    doc.update(over)
    return doc


def actions_doc(
    base_url: str,
    *,
    timeout_s: float = 1.0,
    connect_timeout_s: float = 0.5,
    breaker: dict[str, Any] | None = None,
    actions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole file: the sandbox at ``base_url`` as the one target, and ``actions`` (default: refunds
    and tickets)."""
    return {
        "targets": {
            "sandbox": {
                "base_url": base_url,
                "timeout_s": timeout_s,
                "connect_timeout_s": connect_timeout_s,
                "breaker": breaker or {"fail_max": 1000, "reset_timeout_s": 5},
            }
        },
        "actions": actions
        or {
            "payments.refund.create": action("/v1/refunds", decimal_args=["amount"]),
            "support.ticket.create": action("/v1/tickets"),
        },
    }
