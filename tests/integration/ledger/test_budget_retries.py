"""Budgets that bind spending (issue 51, point 6): a conversation's ``max_retry_billed`` bounds the
retries its calls make after they were accepted, counted at the sandbox (the real pipeline: PostgreSQL,
the relay, a Celery worker, the sandbox over HTTP).

On main a call once accepted kept its own retry budget: six calls against a provider that answers 503
made 6 x 4 = 24 requests in one conversation whose budget allowed 2 retries."""

from __future__ import annotations

from typing import Any

import pytest

from outbox.actions.rules import load_action_rules
from outbox.ledger.scope_models import BudgetCharge, ScopeSpend
from producer.agents.calls import ToolCaller
from producer.client import Outbox
from tests.harness import action, actions_doc, wait_for

REFUND = "payments.refund.create"
ARGS = ["order_id", "amount", "currency", "reason"]
# Four attempts each, quick retries: the operation's own budget would allow three retries per call.
BUDGET = {"max_attempts": 4, "deadline_s": 120, "base_delay_s": 0.05, "max_delay_s": 0.2}


def _setup(pipe: Any, sandbox: Any, scope_budget: dict[str, Any], settle_s: float = 0.5, **over: Any) -> ToolCaller:
    refund = action("/v1/refunds", settle_s=settle_s, decimal_args=["amount"], args=ARGS, budget=BUDGET, **over)
    refund["tool"] = {"reference_args": ["order_id"]}
    doc = actions_doc(sandbox.url, actions={REFUND: refund})
    doc["budget_scope"] = scope_budget
    pipe.write_actions(doc)
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    return ToolCaller(Outbox(pipe.sessions.kw["bind"], rules=rules), rules, tenant="t1", subject="agent:x")


def _refund(order: str) -> dict[str, Any]:
    return {"order_id": order, "amount": "10.00", "currency": "EUR", "reason": "damaged"}


def _posts(sandbox: Any, order: str | None = None) -> list[dict[str, Any]]:
    sent = sandbox.requests(method="POST", path="/v1/refunds")
    return [r for r in sent if order is None or f'"{order}"' in (r.get("idempotency_key") or "")]


@pytest.mark.postgres
@pytest.mark.redis
def test_a_conversations_retries_stop_at_its_budget_counted_at_the_sandbox(pipe, sandbox):
    caller = _setup(pipe, sandbox, {"max_calls": 10, "max_retry_billed": 2})
    sandbox.add_fault(mode="unavailable_503", method="POST", path="/v1/refunds")  # every send: not processed
    pipe.start_worker()
    pipe.start_relay()
    calls = [caller.call(REFUND, _refund(f"o-{n}"), scope="conv-1") for n in range(6)]
    assert all(c.outcome == "PENDING" for c in calls)
    for c in calls:
        pipe.wait_status(c.stored_id, "failed_before_commit", timeout_s=60)

    assert len(_posts(sandbox)) == 6 + 2, "the submits' first attempts and the conversation's two retries, no more"
    with pipe.sessions() as s:
        scope = s.query(ScopeSpend).filter_by(scope="conv-1", bucket="*").one()
        assert scope.retry_billed == 2 and s.query(BudgetCharge).count() == 2
    said = [caller.get(c.stored_id) for c in calls]
    cut = [a for a in said if "budget is spent: 2 of 2 retries used in this conversation" in a.model_message]
    assert len(cut) == 6, [a.model_message for a in said]  # every call ended by the conversation, not its own budget
    assert all(a.outcome == "FAILED_BEFORE_COMMIT" and a.model_message.startswith("Not executed") for a in said)
    # A new call of the spent conversation is refused at once, nothing stored or sent.
    refused = caller.call(REFUND, _refund("o-new"), scope="conv-1")
    assert refused.outcome == "REFUSED" and "its 2 retries are spent" in refused.model_message
    assert len(_posts(sandbox)) == 8


@pytest.mark.postgres
@pytest.mark.redis
def test_an_ambiguous_call_of_a_spent_conversation_is_settled_by_lookups_not_sent_again(pipe, sandbox):
    # A settle window the test passes by moving the ledger's clock: until then "not found" proves nothing.
    # The provider fences (the lookup's newer token shuts out the lost attempt): "not found" then proves
    # it can never land, and the operation may end failed_before_commit (without fencing: a person).
    caller = _setup(pipe, sandbox, {"max_calls": 10, "max_retry_billed": 1}, settle_s=30, provider_fencing=True)
    sandbox.add_fault(mode="drop_before_commit", method="POST", key_pattern='*"o-b"*', count=1)
    sandbox.add_fault(mode="unavailable_503", method="POST", key_pattern='*"o-a"*', count=2)
    pipe.start_worker()
    pipe.start_relay()
    # Reset before anything is processed: in doubt, so parked for lookups, never failed blindly.
    doubt = caller.call(REFUND, _refund("o-b"), scope="conv-2")
    wait_for(lambda: pipe.op(doubt.stored_id).status == "outcome_unknown", 30, what="the reset parked")
    # Another call of the conversation spends its one retry (503, 503) and ends.
    spender = caller.call(REFUND, _refund("o-a"), scope="conv-2")
    pipe.wait_status(spender.stored_id, "failed_before_commit", timeout_s=60)
    assert len(_posts(sandbox, "o-a")) == 2

    # The settle window passes: "not found" proves the first never landed, and the conversation has no
    # retry left for a second send: it ends, sent once.
    pipe.advance_ledger_clock(60, operation_ids=[doubt.stored_id])
    ended = pipe.wait_status(doubt.stored_id, "failed_before_commit", "reconciliation_required", timeout_s=60)
    assert ended.status == "failed_before_commit" and "budget is spent" in (ended.reason or ""), ended.reason
    assert len(_posts(sandbox, "o-b")) == 1, "nothing is sent again once the conversation's retries are spent"
    assert sandbox.effects() == []
