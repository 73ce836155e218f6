"""OUTBOX_DATABASE_URLS: the ledgers one worker fleet drains, and the queues their doorbells take."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from outbox.settings import Settings, parse_ledgers
from workers.engine.queues import ledger_queue
from workers.wiring.celery_app import fleet_queues

A = "postgresql+psycopg://db1/shop"
B = "postgresql+psycopg://db2/crm?sslmode=require"


def test_pairs_in_the_order_given():
    assert parse_ledgers(f" shop={A}, crm={B} ,") == {"shop": A, "crm": B}
    assert list(Settings(database_urls=f"shop={A},crm={B}").ledger_urls) == ["shop", "crm"]


def test_without_it_the_one_ledger_has_no_name():
    settings = Settings(database_url=A)
    assert settings.ledger_urls == {None: A}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (A, "is not name=url"),
        ("Shop=" + A, "is not name=url"),
        ("shop=db1/shop", "is not name=url"),
        (f"shop={A},shop={B}", "named twice"),
        (f"shop={A},crm={A}", "the same database"),
        ("shop=postgresql://db1/shop", "ledger 'shop': use postgresql+psycopg://"),
        ("shop=mysql://db1/shop", "ledger 'shop': unsupported scheme"),
    ],
)
def test_a_bad_value_names_the_pair_and_the_form(value, says):
    with pytest.raises(ValidationError) as err:
        Settings(database_urls=value)
    assert "database_urls" in str(err.value) and says in str(err.value)


def test_each_ledger_has_its_own_queues_and_the_one_ledger_keeps_the_plain_ones():
    assert ledger_queue("dispatch", None) == "dispatch"
    assert ledger_queue("outcome_unknown", "crm") == "outcome_unknown.crm"
    assert fleet_queues(["dispatch"], ["shop", "crm"]) == ["dispatch", "dispatch.shop", "dispatch.crm"]
    assert fleet_queues(["dispatch", "outcome_unknown"], [None]) == ["dispatch", "outcome_unknown"]
    assert fleet_queues(["outcome_unknown"], ["shop"]) == ["outcome_unknown", "outcome_unknown.shop"]
