"""A retry's charge to its conversation costs nothing where there is nothing to charge
(workers/dispatch/scope_budget.py): an operation without a scope, or a call's first attempt, asks the
ledger nothing at all (the hot path's zero extra statements); a scoped retry does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from outbox.ledger.states import AttemptKind
from tests.unit.test_outcomes import claim
from workers.dispatch.scope_budget import charge_before_send
from workers.provider.actions import parse_actions
from workers.sandbox.scenario import action, actions_doc

REFUND = "payments.refund.create"
ACTIONS = parse_actions(
    actions_doc("http://127.0.0.1:9", actions={REFUND: action("/v1/refunds", budget_scope={"max_retry_billed": 2})})
)


class NoLedger:
    """A sessionmaker that fails the test if anything asks it for a session."""

    asked = 0

    def begin(self) -> Any:
        NoLedger.asked += 1
        raise AssertionError("the ledger was asked")

    __call__ = begin


@pytest.mark.parametrize(
    ("scope", "attempt_count"),
    [(None, 1), (None, 3), ("conv-1", 1)],
    ids=["no scope, first attempt", "no scope, a retry", "a scope, the call's first attempt"],
)
def test_nothing_to_charge_asks_the_ledger_nothing(scope: str | None, attempt_count: int):
    c = replace(claim(attempt_count, kind=AttemptKind.DISPATCH), action=REFUND, budget_scope=scope)
    assert charge_before_send(NoLedger(), ACTIONS, c, ACTIONS.action(REFUND)) is None  # type: ignore[arg-type]


def test_a_scoped_retry_is_charged_before_it_leaves():
    c = replace(claim(2, kind=AttemptKind.DISPATCH), action=REFUND, budget_scope="conv-1")
    NoLedger.asked = 0
    with pytest.raises(AssertionError, match="the ledger was asked"):
        charge_before_send(NoLedger(), ACTIONS, c, ACTIONS.action(REFUND))  # type: ignore[arg-type]
    assert NoLedger.asked == 1
