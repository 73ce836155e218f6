"""Budgets per conversation for agents' tool calls (issue 34, part 2; outbox/ledger/budget_scopes.py).

Parallel calls on the last unit of a conversation's money cap make one effect, counted by the sandbox
(PostgreSQL, a real worker, the relay, Redis). On both ledgers: every answer says what is left, a
refusal stores nothing and says why, a replay costs nothing, and the other limits (calls, retries,
deadline). Over HTTP: the ``Outbox-Budget-Scope`` header."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import yaml
from sqlalchemy import update

from outbox.actions.rules import load_action_rules
from outbox.ledger.models import Operation
from outbox.ledger.scope_models import ScopeSpend
from producer.agents.calls import ToolCaller
from producer.client import Outbox
from tests.harness import action, actions_doc

REFUND = "payments.refund.create"
ARGS = ["order_id", "amount", "currency", "reason"]


def _doc(base_url: str, *, own: dict[str, Any], every: dict[str, Any] | None = None) -> dict[str, Any]:
    refund = action("/v1/refunds", decimal_args=["amount"], args=ARGS, budget_scope=own)
    refund["tool"] = {"reference_args": ["order_id"]}
    doc = actions_doc(base_url, actions={REFUND: refund})
    if every is not None:
        doc["budget_scope"] = every
    return doc


def _caller(sessions: Any, rules: Any) -> ToolCaller:
    return ToolCaller(Outbox(sessions.kw["bind"], rules=rules), rules, tenant="t1", subject="agent:x")


def _refund(order: str, amount: str) -> dict[str, Any]:
    return {"order_id": order, "amount": amount, "currency": "EUR", "reason": "damaged"}


CAP = {"max_calls": 20, "max_amount": {"arg": "amount", "limit": 50, "currency": "EUR", "decimals": 0}}


@pytest.mark.postgres
@pytest.mark.redis
def test_parallel_calls_on_the_last_unit_of_the_money_cap_make_one_effect(pipe, sandbox):
    pipe.write_actions(_doc(sandbox.url, own=CAP))
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    caller = _caller(pipe.sessions, rules)
    pipe.start_worker()
    pipe.start_relay()
    rounds, racers = 4, 4
    for n in range(rounds):  # each conversation: 40 of 50 spent, then four calls of 10 at once
        assert caller.call(REFUND, _refund(f"c{n}-first", "40"), scope=f"conv-{n}").outcome != "REFUSED"
    answers: list[Any] = []
    start = threading.Barrier(rounds * racers)

    def race(n: int, i: int) -> None:
        start.wait()
        answers.append((n, caller.call(REFUND, _refund(f"c{n}-race-{i}", "10"), scope=f"conv-{n}")))

    threads = [threading.Thread(target=race, args=(n, i)) for n in range(rounds) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == rounds * racers
    for n in range(rounds):
        mine = [a for m, a in answers if m == n]
        passed = [a for a in mine if a.outcome != "REFUSED"]
        assert len(passed) == 1, [a.model_message for a in mine]
        assert "0 EUR of 50 EUR" in passed[0].model_message
        for refused in (a for a in mine if a.outcome == "REFUSED"):
            assert refused.operation_id is None and "50 EUR of 50 EUR is spent" in refused.model_message
        for a in mine + passed:
            if a.operation_id:
                pipe.wait_status(a.operation_id, "succeeded")
    effects = sandbox.effects()
    assert len(effects) == rounds * 2 and sandbox.duplicates() == []  # the first call and one racer each
    with pipe.sessions() as s:
        assert s.query(Operation).count() == rounds * 2  # a refusal stores nothing


def _rules(tmp_path: Any, **doc: Any) -> Any:
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(_doc("http://127.0.0.1:9", **doc)))
    return load_action_rules(path)


def test_every_answer_says_what_is_left_and_a_replay_costs_nothing(ledger, tmp_path):
    own = {"max_calls": 3, "max_amount": {"arg": "amount", "limit": 50000, "currency": "EUR", "decimals": 2}}
    caller = _caller(ledger.sessions, _rules(tmp_path, own=own))
    first = caller.call(REFUND, _refund("o-1", "12000"), scope="conv-a")
    assert first.new and first.model_message.endswith(
        "Budget: 2 of 3 calls, 380.00 EUR of 500.00 EUR left in this conversation's payments.refund.create calls."
    )
    assert first.budget is not None and first.budget["budgets"][0]["calls"] == 1
    again = caller.call(REFUND, _refund("o-1", "12000"), scope="conv-a")  # the same call: the same operation
    assert again.operation_id == first.operation_id and "2 of 3 calls" in again.model_message
    other = caller.call(REFUND, _refund("o-1", "12000"), scope="conv-b")  # another conversation: its own budget
    assert "2 of 3 calls" in other.model_message

    too_much = caller.call(REFUND, _refund("o-2", "40000"), scope="conv-a")
    assert too_much.outcome == "REFUSED" and too_much.status == "refused"
    assert "120.00 EUR of 500.00 EUR is spent and this call asks 400.00 EUR" in too_much.model_message
    assert "Left: 2 of 3 calls, 380.00 EUR of 500.00 EUR" in too_much.model_message
    for order in ("o-3", "o-4"):
        assert caller.call(REFUND, _refund(order, "100"), scope="conv-a").outcome != "REFUSED"
    used_up = caller.call(REFUND, _refund("o-5", "1"), scope="conv-a")
    assert used_up.outcome == "REFUSED" and "its 3 calls are used" in used_up.model_message
    with ledger.sessions() as s:
        assert s.query(Operation).filter(Operation.budget_scope == "conv-a").count() == 3


def test_the_conversation_wide_budget_retries_and_deadline(ledger, tmp_path):
    every = {"max_calls": 2, "max_retry_billed": 1}
    caller = _caller(ledger.sessions, _rules(tmp_path, own={"deadline_s": 3600}, every=every))
    first = caller.call(REFUND, _refund("o-1", "1"), scope="conv")
    assert "1 of 2 calls, 1 of 1 retries left in this conversation" in first.model_message
    with ledger.sessions.begin() as s:  # the first call's two retries, charged as they left (budget_charges.py)
        s.execute(update(ScopeSpend).where(ScopeSpend.scope == "conv").values(retry_billed=2))
    spent = caller.call(REFUND, _refund("o-2", "1"), scope="conv")
    assert spent.outcome == "REFUSED" and "its 1 retries are spent" in spent.model_message

    short = _caller(ledger.sessions, _rules(tmp_path, own={"deadline_s": 0.001}))
    assert short.call(REFUND, _refund("o-1", "1"), scope="late").outcome != "REFUSED"
    import time

    time.sleep(0.05)
    late = short.call(REFUND, _refund("o-2", "1"), scope="late")
    assert late.outcome == "REFUSED" and "since the first call are over" in late.model_message
    assert short.call(REFUND, _refund("o-1", "1"), scope="late").outcome != "REFUSED"  # a replay still answers


def test_budget_scopes_are_checked_when_the_file_is_read(tmp_path):
    from outbox.actions.files import ActionsFileError
    from workers.provider.actions import parse_actions

    bad = (
        ({"own": {}}, "at least one of"),
        ({"own": {"max_amount": {"arg": "amount_cents", "limit": 5}}}, "not in args"),
        ({"own": {"max_calls": 0}}, "greater than 0"),
        ({"own": {"max_calls": 1}, "every": {"max_amount": {"arg": "amount", "limit": 5}}}, "belongs in an action"),
    )
    for doc, said in bad:
        with pytest.raises(ActionsFileError, match=said):
            parse_actions(_doc("http://127.0.0.1:9", **doc))
        path = tmp_path / "a.yaml"
        path.write_text(yaml.safe_dump(_doc("http://127.0.0.1:9", **doc)))
        if said != "not in args":  # the producer's reader does not compare against args for amounts
            with pytest.raises(ActionsFileError, match=said):
                load_action_rules(path)


@pytest.mark.postgres
@pytest.mark.redis
def test_the_http_api_charges_the_conversation_named_by_its_header(pipe, sandbox):
    from tests.integration.surfaces.test_api import _key, _serve

    pipe.write_actions(_doc(sandbox.url, own={"max_calls": 1}))
    with _serve(pipe) as api, api.client(_key(api.env, "acme", "submit,read")) as c:
        body = {"action": REFUND, "args": _refund("o-1", "5")}
        scoped = {"Outbox-Budget-Scope": "conv-9"}
        first = c.post("/v1/intents", json=body | {"idempotency_key": "h-1"}, headers=scoped)
        assert first.status_code == 201 and first.json()["budget"]["left"].startswith("0 of 1 calls"), first.text
        refused = c.post("/v1/intents", json=body | {"idempotency_key": "h-2"}, headers=scoped)
        assert refused.status_code == 409 and refused.json()["type"].endswith("/budget-exhausted"), refused.text
        assert refused.json()["outcome"] == "REFUSED" and "its 1 calls are used" in refused.json()["detail"]
        unscoped = c.post("/v1/intents", json=body | {"idempotency_key": "h-3"})  # no conversation: no budget
        assert unscoped.status_code == 201 and "budget" not in unscoped.json()
        batch = c.post("/v1/intents:batch", json={"intents": [body | {"idempotency_key": "h-4"}]}, headers=scoped)
        assert batch.json()["results"][0]["status"] == 409


@pytest.mark.postgres
@pytest.mark.redis
def test_the_python_http_client_names_the_conversation_and_reads_the_refusal(pipe, sandbox):
    from producer.remote import BudgetExhausted, OutboxClient
    from tests.integration.surfaces.test_api import _key, _serve

    pipe.write_actions(_doc(sandbox.url, own=CAP))
    with _serve(pipe) as api, OutboxClient(api.url, _key(api.env, "acme", "submit,read")) as client:
        first = client.submit(REFUND, _refund("o-1", "45"), idempotency_key="py-1", budget_scope="conv-py")
        assert first.budget is not None and "5 EUR of 50 EUR" in first.budget["left"]
        assert first.budget_scope == "conv-py"
        with pytest.raises(BudgetExhausted) as refused:
            client.submit(REFUND, _refund("o-2", "10"), idempotency_key="py-2", budget_scope="conv-py")
        assert refused.value.outcome == "REFUSED" and refused.value.budget["budgets"][0]["amount"] == "45"
