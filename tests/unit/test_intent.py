"""The Intent value: validated where it is built, in one place, each bad field named with its fix."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import pytest

from outbox.errors import InvalidIntent
from outbox.ledger.envelope import build_envelope
from outbox.ledger.intent import MAX_KEY_LEN, MAX_SECONDS, PRIORITY_RULE, Intent
from producer.keywords import IntentFields, as_intent

GOOD = dict(
    tenant="acme",
    idempotency_key="wf-81:invoice-17:refund-2:v1",
    action="payments.refund.create",
    args={"order_id": "o-17", "amount": Decimal("25.00"), "currency": "EUR"},
    subject="agent:support-bot",
)
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_good_intent_is_held_as_validated():
    intent = Intent(**GOOD, traceparent=TRACE.upper(), deadline_s=60, delay_s=5, requires_approval=0)
    env = build_envelope(tenant="acme", action=GOOD["action"], args=GOOD["args"], subject=GOOD["subject"])
    assert intent.envelope == env and intent.args_digest == env.digest
    assert intent.args == {"order_id": "o-17", "amount": Decimal("25"), "currency": "EUR"}  # canonical
    assert intent.traceparent == TRACE  # lower case, as stored
    assert intent.deadline_s == 60.0 and isinstance(intent.deadline_s, float) and intent.delay_s == 5.0
    assert intent.requires_approval is False
    assert (intent.priority, intent.key_space, intent.max_attempts) == (0, "intent", None)


def test_an_intent_never_changes_not_even_with_the_callers_dict():
    args = dict(GOOD["args"])
    intent = Intent(**GOOD | {"args": args})
    args["amount"] = Decimal("9999")
    assert intent.args["amount"] == Decimal("25")
    assert intent.envelope.digest == Intent(**GOOD).envelope.digest
    with pytest.raises(dataclasses.FrozenInstanceError):
        intent.priority = 5  # type: ignore[misc]


def test_equal_intents_compare_equal_and_replace_validates_again():
    a = Intent(**GOOD)
    assert a == Intent(**GOOD | {"args": {"currency": "EUR", "amount": Decimal("25"), "order_id": "o-17"}})
    assert dataclasses.replace(a, priority=7).priority == 7
    with pytest.raises(InvalidIntent) as info:
        dataclasses.replace(a, priority=101)
    assert info.value.field == "priority"


BAD = [
    ("tenant", {"tenant": ""}, "required: a non-empty string"),
    ("tenant", {"tenant": None}, "required: a non-empty string"),
    ("tenant", {"tenant": " acme"}, "must not start or end with whitespace"),
    ("tenant", {"tenant": "ac\x00me"}, "must not contain a NUL character"),
    ("idempotency_key", {"idempotency_key": None}, "required: a stable business key"),
    ("idempotency_key", {"idempotency_key": " k"}, f"must be 1-{MAX_KEY_LEN} characters"),
    ("idempotency_key", {"idempotency_key": "k" * (MAX_KEY_LEN + 1)}, f"must be 1-{MAX_KEY_LEN} characters"),
    ("idempotency_key", {"idempotency_key": "k\ud800"}, "must be valid Unicode text"),
    ("action", {"action": "pay ments"}, "must not contain whitespace"),
    ("action", {"action": "pay\u2003ments"}, "must not contain whitespace"),  # an em space
    ("subject", {"subject": 7}, "required: a non-empty string"),
    ("args", {"args": [1]}, "must be a JSON object, got list"),
    ("args.amount", {"args": {"amount": 0.1}}, "binary float 0.1 cannot carry an exact amount"),
    ("run_id", {"run_id": 17}, "must be a string of at most 255 characters"),
    ("run_id", {"run_id": "r\x00"}, "must not contain a NUL character"),
    ("tool_call_id", {"tool_call_id": "t" * 256}, "must be a string of at most 255 characters"),
    ("max_attempts", {"max_attempts": 0}, "must be an integer >= 1"),
    ("max_attempts", {"max_attempts": True}, "must be an integer >= 1"),
    ("deadline_s", {"deadline_s": 0}, "must be a positive number of seconds"),
    ("deadline_s", {"deadline_s": MAX_SECONDS * 2}, f"up to {MAX_SECONDS:.0f}"),
    ("deadline_s", {"deadline_s": Decimal("5")}, "must be a positive number of seconds"),
    ("delay_s", {"delay_s": -1}, "must be >= 0"),
    ("delay_s", {"delay_s": None}, "must be >= 0"),
    ("priority", {"priority": 101}, PRIORITY_RULE),
    ("priority", {"priority": True}, PRIORITY_RULE),
    ("traceparent", {"traceparent": "00-nope"}, "ids not all zero"),
    ("submitted_by", {"submitted_by": ""}, "must be a string of 1-255 characters"),
    ("submitted_by", {"submitted_by": 12}, "must be a string of 1-255 characters"),
    ("submitted_by", {"submitted_by": "key:\x00"}, "must not contain a NUL character"),
    ("key_space", {"key_space": "mine"}, "must be one of intent, run"),
    ("provider_key", {"provider_key": ""}, "must be a string of 1-255 characters"),
    ("provider_key", {"provider_key": "p\x00"}, "must not contain a NUL character"),
    ("budget_scope", {"budget_scope": " "}, "must be the host's conversation, run or thread id"),
    ("budget_scope", {"budget_scope": "s\ud800"}, "must be valid Unicode text"),
]


@pytest.mark.parametrize(("field", "bad", "says"), BAD, ids=[f"{f}={b[next(iter(b))]!r}"[:40] for f, b, _ in BAD])
def test_each_bad_field_is_named_with_its_fix(field, bad, says):
    with pytest.raises(InvalidIntent) as info:
        Intent(**GOOD | bad)
    assert info.value.field == field
    assert says in info.value.reason
    assert isinstance(info.value, ValueError)  # as the ledger has always raised it


def test_the_first_bad_field_is_the_one_named():
    # The order callers have always seen: the key, the priority, the trace, the envelope, the budget.
    with pytest.raises(InvalidIntent) as info:
        Intent(**GOOD | {"idempotency_key": "", "priority": 500, "args": 3})
    assert info.value.field == "idempotency_key"
    with pytest.raises(InvalidIntent) as info:
        Intent(**GOOD | {"max_attempts": 0, "args": 3})
    assert info.value.field == "args"


def test_a_missing_or_unknown_field_is_a_programming_error():
    with pytest.raises(TypeError, match="subject"):
        Intent(**{k: v for k, v in GOOD.items() if k != "subject"})
    with pytest.raises(TypeError, match="colour"):
        Intent(**GOOD, colour="red")
    with pytest.raises(TypeError):
        Intent(*GOOD.values())  # type: ignore[misc]  # keywords only: eighteen fields are not read by position
    with pytest.raises(TypeError):
        Intent(**GOOD, envelope=None)  # computed, never given


def test_the_keyword_form_builds_the_same_intent_or_takes_one_built():
    fields = {k: v for k, v in GOOD.items() if k != "tenant"}
    built = Intent(**GOOD, priority=3)
    assert as_intent(None, "acme", fields | {"priority": 3}) == built
    assert as_intent(built, None, {}) is built
    with pytest.raises(TypeError, match="not both"):
        as_intent(built, None, {"priority": 4})
    with pytest.raises(TypeError, match="not both"):
        as_intent(built, "acme", {})
    with pytest.raises(TypeError, match="Intent or keywords"):
        as_intent(dict(GOOD), None, {})  # type: ignore[arg-type]
    with pytest.raises(InvalidIntent) as info:
        as_intent(None, None, fields)
    assert info.value.field == "tenant"


def test_the_keywords_typed_for_people_are_the_intents_fields():
    keyword_fields = set(IntentFields.__annotations__) | {"tenant"}
    assert keyword_fields == {f.name for f in dataclasses.fields(Intent) if f.init}
