"""A run as submitted (outbox/runs/spec.py): bad input names the field and the fix; the digest makes
a resubmission the same run and a change a conflict; keys are derived, never from a retry."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from outbox.actions.rules import ActionRules
from outbox.errors import InvalidIntent
from outbox.runs.spec import build_run_spec

STEPS = [
    {
        "name": "order",
        "action": "shop.order.create",
        "args": {"order_ref": "po-1"},
        "compensate": {"action": "shop.cancel", "args": {"undoes": "po-1"}},
    },
    {"name": "notify", "action": "notify.email.send", "args": {"to": "a@example.com"}},
]


def spec(steps: Any = STEPS, **kw: Any) -> Any:
    return build_run_spec(**({"tenant": "t1", "run_key": "po-1", "steps": steps, "subject": "agent:x"} | kw))


def field_of(**kw: Any) -> str:
    with pytest.raises(InvalidIntent) as err:
        spec(**kw)
    return err.value.field


def test_keys_are_derived_from_the_run_key_and_the_step_name():
    s = spec()
    assert [st.key("po-1") for st in s.steps] == ["po-1:order", "po-1:notify"]
    assert s.steps[0].compensation_key("po-1") == "po-1:order:compensate"
    assert s.steps[0].provider_key == "t1:po-1:order"  # the default provider key rule


def test_the_digest_is_the_run_and_changes_with_any_step_or_budget():
    same = spec(steps=[dict(STEPS[0], args={"order_ref": "po-1"}), STEPS[1]])
    assert spec().digest == same.digest
    assert spec(budget={"deadline_s": 60}).digest == spec(budget={"deadline_s": Decimal("60.0")}).digest
    assert spec(budget={"max_attempts": 3}).digest != spec().digest
    assert spec(steps=[STEPS[0], dict(STEPS[1], args={"to": "b@example.com"})]).digest != spec().digest
    assert spec(steps=list(reversed(STEPS))).digest != spec().digest


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"steps": []}, "steps"),
        ({"steps": [STEPS[0], dict(STEPS[1], name="order")]}, "steps[1].name"),
        ({"steps": [dict(STEPS[0], name="a:b")]}, "steps[0].name"),
        ({"steps": [dict(STEPS[0], name="compensate")]}, "steps[0].name"),
        ({"steps": [dict(STEPS[0], args={"amount": 0.1})]}, "steps[0].args.amount"),
        ({"steps": [dict(STEPS[0], extra=1)]}, "steps[0].extra"),
        ({"steps": [dict(STEPS[0], compensate={"action": "x", " args": {}})]}, "steps[0].compensate"),
        ({"steps": [dict(STEPS[0], compensate={"action": "has space"})]}, "steps[0].compensate.action"),
        ({"budget": {"max_attempts": 0}}, "budget.max_attempts"),
        ({"budget": {"deadline_s": -1}}, "budget.deadline_s"),
        ({"budget": {"retries": 3}}, "budget.retries"),
        ({"run_key": " po "}, "run_key"),
        ({"run_key": "k" * 250}, "steps[0].name"),
    ],
)
def test_bad_input_names_the_field(kw, field):
    assert field_of(**kw) == field


def _rules(**phases: str) -> ActionRules:
    return ActionRules({}, {}, phases, frozenset({"ledger.accrual.post"}))


def test_the_commit_step_is_the_last_and_the_only_one():
    draft, commit = (
        {"name": "d", "action": "quote.draft", "args": {}},
        {"name": "c", "action": "quote.commit", "args": {}},
    )
    rules = _rules(**{"quote.draft": "draft", "quote.commit": "commit"})
    ok = build_run_spec(tenant="t", run_key="q", steps=[draft, commit], subject="s", rules=rules)
    assert [s.phase for s in ok.steps] == ["draft", "commit"]
    with pytest.raises(InvalidIntent, match="last step") as err:
        build_run_spec(tenant="t", run_key="q", steps=[commit, dict(draft)], subject="s", rules=rules)
    assert err.value.field == "steps[0].action"
    with pytest.raises(InvalidIntent, match="at most one commit"):
        build_run_spec(tenant="t", run_key="q", steps=[commit, dict(commit, name="c2")], subject="s", rules=rules)


def test_an_irreversible_action_cannot_declare_a_compensation():
    step = {"name": "acc", "action": "ledger.accrual.post", "args": {}, "compensate": {"action": "x.y", "args": {}}}
    with pytest.raises(InvalidIntent, match="irreversible") as err:
        build_run_spec(tenant="t", run_key="r", steps=[step], subject="s", rules=_rules())
    assert err.value.field == "steps[0].compensate"
    plain = build_run_spec(tenant="t", run_key="r", steps=[dict(step, compensate=None)], subject="s", rules=_rules())
    assert plain.steps[0].irreversible
