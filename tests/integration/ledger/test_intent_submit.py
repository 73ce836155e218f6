"""The ledger takes one Intent; every keyword form beside it writes the very same row."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest
import yaml
from sqlalchemy import select

from outbox.actions.rules import load_action_rules
from outbox.errors import IdempotencyConflict, InvalidIntent
from outbox.ledger.db import make_async_engine
from outbox.ledger.intent import Intent
from outbox.ledger.models import Operation
from outbox.ledger.submit import submit as ledger_submit
from producer import AsyncOutbox, Outbox, submit, submit_async
from workers.sandbox.scenario import action, actions_doc

FIELDS = dict(
    action="payments.refund.create",
    args={"order_id": "o-17", "amount": Decimal("600.00"), "currency": "EUR"},
    subject="agent:support-bot",
    run_id="run-9",
    tool_call_id="call-3",
    max_attempts=3,
    deadline_s=600,
    delay_s=2,
    priority=5,
    submitted_by="key:12",
    traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
)
# What differs between two rows of one intent under two keys; everything else must be the same.
PER_ROW = {"id", "idempotency_key", "provider_key", "submit_event_id"} | {
    "created_at",
    "updated_at",
    "next_attempt_at",
    "deadline_at",
}


@pytest.fixture
def rules(tmp_path):
    doc = actions_doc(
        "http://127.0.0.1:9",
        actions={
            "payments.refund.create": action(
                "/v1/refunds",
                decimal_args=["amount"],
                provider_key="acme-{idempotency_key}",
                approval={"required": "when", "when": "amount > 500", "ttl_s": 600},
            )
        },
    )
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_action_rules(path)


def _row(ledger, operation_id):
    with ledger.sessions() as s:
        op = s.execute(select(Operation).where(Operation.id == operation_id)).scalar_one()
        return {c.key: getattr(op, c.key) for c in Operation.__table__.columns}


def test_an_intent_and_the_keywords_write_the_same_row(ledger, rules):
    with ledger.sessions.begin() as s:
        by_intent = ledger_submit(s, Intent(tenant="acme", idempotency_key="k-intent", **FIELDS), rules=rules)
        by_keywords = submit(s, tenant="acme", idempotency_key="k-keywords", **FIELDS, rules=rules)
        positional = submit(s, Intent(tenant="acme", idempotency_key="k-positional", **FIELDS), rules=rules)
    rows = [_row(ledger, r.operation_id) for r in (by_intent, by_keywords, positional)]
    same = [{k: v for k, v in row.items() if k not in PER_ROW} for row in rows]
    assert same[0] == same[1] == same[2]
    assert [row["provider_key"] for row in rows] == ["acme-k-intent", "acme-k-keywords", "acme-k-positional"]
    row = rows[0]
    assert row["status"] == "awaiting_approval"  # the actions file's rule, applied at submit
    assert (row["priority"], row["max_attempts"], row["submitted_by"], row["run_id"]) == (5, 3, "key:12", "run-9")
    assert row["traceparent"] is not None and by_intent.args_digest == by_keywords.args_digest


def test_either_form_replays_the_other_and_a_change_conflicts(ledger):
    with ledger.sessions.begin() as s:
        first = submit(s, tenant="acme", idempotency_key="k-1", **FIELDS)
    with ledger.sessions.begin() as s:
        again = ledger_submit(s, Intent(tenant="acme", idempotency_key="k-1", **FIELDS))
    assert again.operation_id == first.operation_id and not again.new
    with ledger.sessions.begin() as s, pytest.raises(IdempotencyConflict):
        ledger_submit(s, Intent(tenant="acme", idempotency_key="k-1", **FIELDS | {"args": {"order_id": "o-18"}}))


def test_a_bad_field_is_refused_before_anything_is_written(ledger):
    outbox = Outbox(ledger.engine, default_tenant="acme")
    with pytest.raises(InvalidIntent) as info:
        outbox.submit(idempotency_key="k-bad", **FIELDS | {"priority": 1000})
    assert info.value.field == "priority"
    with pytest.raises(TypeError, match="not both"):
        outbox.submit(Intent(tenant="acme", idempotency_key="k-both", **FIELDS), priority=1)
    with ledger.sessions.begin() as s, pytest.raises(TypeError, match="takes an Intent"):
        ledger_submit(s, dict(FIELDS, tenant="acme", idempotency_key="k-dict"))  # type: ignore[arg-type]
    with ledger.sessions() as s:
        assert s.execute(select(Operation.id)).first() is None


def test_the_clients_take_an_intent_or_keywords(ledger, rules):
    outbox = Outbox(ledger.engine, default_tenant="acme", rules=rules)
    by_keywords = outbox.submit(idempotency_key="k-client", **FIELDS)
    by_intent = outbox.submit(Intent(tenant="acme", idempotency_key="k-client", **FIELDS))
    assert by_intent.operation_id == by_keywords.operation_id and by_keywords.status == "awaiting_approval"
    assert by_keywords.provider_key == "acme-k-client"  # the outbox's rules, either way

    async def from_asyncio() -> list[str]:
        engine = make_async_engine(ledger.url)
        try:
            aio = AsyncOutbox(engine, default_tenant="acme", rules=rules)
            seen = [(await aio.submit(idempotency_key="k-client", **FIELDS)).operation_id]
            seen.append((await aio.submit(Intent(tenant="acme", idempotency_key="k-client", **FIELDS))).operation_id)
            async with aio.sessions.begin() as session:
                seen.append(
                    (await submit_async(session, tenant="acme", idempotency_key="k-client", **FIELDS)).operation_id
                )
            async with aio.sessions.begin() as session:
                intent = Intent(tenant="acme", idempotency_key="k-client", **FIELDS)
                seen.append((await submit_async(session, intent)).operation_id)
            return seen
        finally:
            await engine.dispose()

    assert set(asyncio.run(from_asyncio())) == {by_keywords.operation_id}
