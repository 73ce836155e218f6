"""A submit answered from what its insert wrote (outbox/reads/queries.py submitted_detail) equals a read
of the committed row, field for field, on both ledgers: the HTTP API answers a new intent without
reading it back (issue 35), so any column the answer would get wrong shows up here."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import yaml

from outbox.actions.rules import load_action_rules
from outbox.service import operations
from producer import submit
from tests.harness import action, actions_doc

REFUND = "payments.refund.create"
ARGS = {"order_id": "o-17", "amount": Decimal("25.00"), "currency": "EUR", "reason": "damaged"}
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _rules(tmp_path: Any) -> Any:
    refund = action(
        "/v1/refunds",
        args=list(ARGS),
        object="order:{order_id}",
        approval={"required": "when", "when": "amount > 100"},
        budget_scope={"max_calls": 5, "max_amount": {"arg": "amount", "limit": 500, "currency": "EUR"}},
    )
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(actions_doc("http://127.0.0.1:9", actions={REFUND: refund}), sort_keys=False))
    return load_action_rules(path)


def test_a_new_intents_answer_is_what_reading_it_back_shows(ledger, tmp_path):
    rules = _rules(tmp_path)
    variants: list[dict[str, Any]] = [
        {},
        {"deadline_s": 600.5, "max_attempts": 3, "priority": 7},
        {"delay_s": 30.0, "run_id": "run-1", "tool_call_id": "call-1", "submitted_by": "api:key-1"},
        {"traceparent": TRACE},
        {"rules": rules, "budget_scope": "conv-1"},  # an object, a budget
        {"rules": rules, "args": ARGS | {"amount": Decimal("250.00")}},  # awaiting approval
        {"requires_approval": True, "provider_key": "given-key"},
    ]
    answered: dict[str, dict[str, Any]] = {}
    with ledger.sessions.begin() as s:
        for i, over in enumerate(variants):
            intent = {"tenant": "t1", "idempotency_key": f"k-{i}", "action": REFUND, "args": ARGS, "subject": "agent"}
            receipt = submit(s, **(intent | over))
            assert receipt.new and receipt.written is not None, over
            answered[receipt.operation_id] = operations.submitted(s, receipt)
        replay = submit(s, tenant="t1", idempotency_key="k-0", action=REFUND, args=ARGS, subject="agent")
        assert replay.written is None, "a replay wrote nothing: it is read"
        assert operations.submitted(s, replay) == answered[replay.operation_id]
    statuses = set()
    with ledger.sessions() as s:
        for operation_id, answer in answered.items():
            read = operations.read(s, "t1", operation_id)
            assert answer == read, {k: (answer.get(k), read.get(k)) for k in read if answer.get(k) != read.get(k)}
            statuses.add(read["status"])
    assert statuses == {"not_dispatched", "awaiting_approval"}, "both kinds of new row were compared"
    assert {a["object"] for a in answered.values()} == {None, "order:o-17"}
