"""What a tool call's key and words are (issue 51, points 4 and 5): ``occurrence`` changes the key only
when given (existing keys stay as they were: pinned below as main computed them), every tool says what
it is for, and the typed outcome's ``stage`` and sentences tell queued from accepted, and a result of
its own ("Done:") from a replay's ("Already done")."""

from __future__ import annotations

from typing import Any

import pytest

from outbox.errors import InvalidIntent
from outbox.ledger.typed_outcome import Stage, model_message, stage_of, with_outcome
from producer.agents.call_keys import call_key, occurrence_of
from producer.agents.catalog import OCCURRENCE, catalog

REFUND = "payments.refund.create"
ARGS = {"order_id": "o-81", "amount": "12.50"}


def test_a_call_without_occurrence_keeps_the_key_it_always_had():
    # Computed by main's producer/agents/calls.py call_key, before occurrence existed.
    assert call_key("conv-1", REFUND, ARGS) == "conv-1:payments.refund.create:args=aa60cdb44ecf01feb415cf133c915336"
    assert call_key("conv-1", REFUND, ARGS, ("order_id",)) == 'conv-1:payments.refund.create:ref="o-81"'
    assert call_key("conv-1", REFUND, ARGS, ("order_id",), 1) == call_key("conv-1", REFUND, ARGS, ("order_id",))


@pytest.mark.parametrize(
    ("given", "spelled"), [(None, None), (1, None), ("1", None), (2, "2"), (" 2 ", "2"), ("refund-b", "refund-b")]
)
def test_occurrence_is_spelled_once(given: Any, spelled: str | None):
    assert occurrence_of(given) == spelled


@pytest.mark.parametrize("bad", [0, -1, 1001, True, 2.5, "", "a b", "x" * 65, {"n": 2}])
def test_a_bad_occurrence_is_refused_naming_the_field(bad: Any):
    with pytest.raises(InvalidIntent) as refused:
        occurrence_of(bad)
    assert refused.value.field == OCCURRENCE


def test_another_occurrence_is_another_key_and_the_same_one_the_same():
    second = call_key("conv-1", REFUND, ARGS, ("order_id",), 2)
    assert second == 'conv-1:payments.refund.create:ref="o-81":occurrence=2'
    assert call_key("conv-1", REFUND, ARGS, ("order_id",), "2") == second
    assert call_key("conv-1", REFUND, ARGS, ("order_id",), 3) != second
    long = call_key("c" * 128, "a" * 200, ARGS, (), "label-" + "x" * 50)
    assert len(long) <= 255 and long != call_key("c" * 128, "a" * 200, ARGS)


def test_every_tool_says_what_occurrence_is_for():
    from outbox.actions.rules import ActionRules
    from outbox.ledger.provider_keys import DEFAULT_TEMPLATE, KeyRule

    rule = KeyRule(DEFAULT_TEMPLATE)
    rules = ActionRules(keys={REFUND: rule, "support.ticket.create": rule}, approvals={})
    for view in catalog(rules).values():
        assert "only to make another one of the same call" in view.description
        described = view.input_schema["properties"][OCCURRENCE]["description"]
        assert "only to make another one of the same call" in described


def _op(status: str, **extra: Any) -> dict[str, Any]:
    return {"status": status, "action": REFUND, "result": {"reference": "re_1"}, "reason": "why"} | extra


@pytest.mark.parametrize(
    ("op", "stage", "starts"),
    [
        (_op("not_dispatched", attempts=0, request=None), Stage.QUEUED, "Queued, not sent yet"),
        (_op("not_dispatched", attempts=0, request=None, waiting_for="breaker"), Stage.QUEUED, "Queued, not sent yet"),
        (_op("not_dispatched", attempts=1, request=None), Stage.IN_PROGRESS, "In progress, not finished"),
        (_op("not_dispatched", attempts=0, request={"digest": "d"}), Stage.IN_PROGRESS, "In progress, not finished"),
        (_op("dispatching", attempts=1), Stage.IN_PROGRESS, "In progress, not finished"),
        (_op("accepted", attempts=1), Stage.ACCEPTED, "Accepted, not finished"),
        (_op("succeeded"), None, "Done: "),
        (_op("outcome_unknown"), None, "Outcome unknown"),
    ],
)
def test_the_stage_and_its_words(op: dict[str, Any], stage: Stage | None, starts: str):
    assert stage_of(op) is stage
    shown = with_outcome(op)
    assert shown["stage"] == (stage.value if stage else None)
    assert shown["model_message"].startswith(starts), shown["model_message"]


def test_queued_and_accepted_never_share_words_and_a_replay_alone_reads_already_done():
    queued = model_message(_op("not_dispatched", attempts=0, request=None))
    accepted = model_message(_op("accepted", attempts=1))
    assert "Accepted" not in queued and "Queued" not in accepted
    assert model_message(_op("succeeded")) == "Done: payments.refund.create succeeded (reference re_1); do not retry."
    assert model_message(_op("succeeded"), replay=True).startswith("Already done: an earlier call")
    assert with_outcome(_op("succeeded"), replay=True)["model_message"].startswith("Already done")
