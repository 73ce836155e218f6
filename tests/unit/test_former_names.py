"""Names users script against that were renamed keep working, with a DeprecationWarning naming the
new one: ``key_rules=`` (now ``rules=``), ``IntentRules`` and ``load_intent_rules`` (now
``ActionRules`` and ``load_action_rules``)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from outbox.actions import rules as rules_module
from producer import Outbox
from producer.keywords import former_rules


def test_key_rules_is_taken_as_rules_with_a_warning():
    given = {"key_rules": "the file", "action": "x"}
    with pytest.warns(DeprecationWarning, match="key_rules= is now rules="):
        assert former_rules(None, given) == "the file"
    assert given == {"action": "x"}
    assert former_rules("mine", {}) == "mine"


def test_both_names_at_once_is_refused():
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="once, as rules="):
        former_rules("a", {"key_rules": "b"})


def test_the_outbox_client_takes_its_former_keyword():
    engine = create_engine("sqlite://")
    with pytest.warns(DeprecationWarning):
        outbox = Outbox(engine, key_rules="the file")  # type: ignore[arg-type]
    assert outbox.rules == "the file"
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        Outbox(engine, rulez=1)  # type: ignore[arg-type]


def test_the_former_class_and_loader_names_resolve_to_the_new_ones():
    with pytest.warns(DeprecationWarning, match="IntentRules is now ActionRules"):
        assert rules_module.IntentRules is rules_module.ActionRules
    with pytest.warns(DeprecationWarning, match="load_intent_rules is now load_action_rules"):
        assert rules_module.load_intent_rules is rules_module.load_action_rules
    with pytest.raises(AttributeError):
        rules_module.NoSuchName  # noqa: B018


def test_submit_takes_its_session_as_a_keyword_too():
    from sqlalchemy.orm import Session

    from outbox.ledger.models import Base
    from producer import submit

    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine)
    args = {"tenant": "t", "idempotency_key": "k-1", "action": "a.b", "args": {"x": 1}, "subject": "s"}
    with Session(engine) as session, session.begin():
        by_keyword = submit(session=session, **args)
        by_position = submit(session, **args)
    assert by_keyword.new and not by_position.new and by_keyword.operation_id == by_position.operation_id
    with pytest.raises(TypeError, match="session"):
        submit(**args)  # type: ignore[call-overload]
