"""OUTBOX_FAIRNESS and OUTBOX_TENANT_WEIGHTS (outbox/settings.py): what a claim is told, and a bad
value refused at start-up with the variable named and the form expected; the priority's range."""

from __future__ import annotations

import pytest

from outbox.errors import ConfigError, InvalidIntent
from outbox.ledger.fairness import Fairness, FairnessMode
from outbox.ledger.intent import validate_priority
from outbox.settings import load_settings, parse_weights


def test_weights_parse_into_shares_and_unnamed_tenants_weigh_one():
    assert parse_weights("acme=3, globex=1,") == {"acme": 3.0, "globex": 1.0}
    assert parse_weights("") == {}
    fairness = Fairness(weights=parse_weights("acme=2.5"))
    assert (fairness.weight("acme"), fairness.weight("initech")) == (2.5, 1.0)


@pytest.mark.parametrize("bad", ["acme", "acme=0", "acme=-1", "=3", "acme=x", "acme=1001", "acme=1,acme=2", "a=nan"])
def test_a_bad_weight_names_the_variable_and_the_form(monkeypatch, bad):
    monkeypatch.setenv("OUTBOX_TENANT_WEIGHTS", bad)
    with pytest.raises(ConfigError, match=r"OUTBOX_TENANT_WEIGHTS: .*tenant=weight.*acme=3,globex=1"):
        load_settings()


def test_fairness_defaults_to_tenants_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("OUTBOX_FAIRNESS", raising=False)
    assert load_settings().fairness is FairnessMode.TENANT
    monkeypatch.setenv("OUTBOX_FAIRNESS", "off")
    assert load_settings().fairness is FairnessMode.OFF and not Fairness(FairnessMode.OFF).on
    monkeypatch.setenv("OUTBOX_FAIRNESS", "round-robin")
    with pytest.raises(ConfigError, match="OUTBOX_FAIRNESS"):
        load_settings()


def test_a_claim_is_told_its_cursor_and_weights_and_remembers_the_last_tenant_served():
    fairness = Fairness(weights={"acme": 3.0})
    assert fairness.claim_params() == {"after_tenant": "", "weight_tenants": ["acme"], "weights": [3.0]}
    fairness.served("globex")
    fairness.served(None)
    assert fairness.claim_params()["after_tenant"] == "globex"


@pytest.mark.parametrize("bad", [101, -101, 1.5, True, "5", None])
def test_priority_outside_its_range_is_refused_naming_the_field_and_the_fix(bad):
    with pytest.raises(InvalidIntent) as raised:
        validate_priority(bad)
    assert raised.value.field == "priority"
    assert "priority must be an integer from -100 to 100, higher runs sooner" in str(raised.value)
    assert validate_priority(-100) == -100 and validate_priority(100) == 100
