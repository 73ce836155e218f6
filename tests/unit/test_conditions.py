"""The approval rule's expression: safe by construction, exact with money (issue 17)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from outbox.actions.conditions import ConditionError, evaluate, parse_condition
from tests.unit.test_actions import ENV, mutated
from workers.provider.actions import ActionsFileError, parse_actions


@pytest.mark.parametrize(
    ("expr", "args", "expected"),
    [
        ("amount > 500", {"amount": Decimal("500.01")}, True),
        ("amount > 500", {"amount": "900.00"}, True),  # money travels as decimal strings
        ("amount > 500", {"amount": "500.00"}, False),
        ("amount > 500", {}, False),  # missing: the rule does not apply
        ("amount > 500", {"amount": "lots"}, False),
        ("currency == 'EUR' and amount >= 100", {"currency": "EUR", "amount": "100"}, True),
        ("currency == 'EUR' and amount >= 100", {"currency": "USD", "amount": "100"}, False),
        ("customer.tier in ['gold', 'vip'] or not verified", {"customer": {"tier": "vip"}, "verified": True}, True),
        ("not verified", {"verified": False}, True),
        ("0.1 + 0.2 == 0.3", {}, None),
    ],
)
def test_evaluation(expr, args, expected):
    if expected is None:
        with pytest.raises(ConditionError):
            parse_condition(expr)
        return
    assert evaluate(parse_condition(expr), args) is expected


@pytest.mark.parametrize(
    "expr", ["__import__('os').system('x')", "amount.__class__", "[x for x in args]", "f(amount)", "amount[0] > 1"]
)
def test_nothing_of_python_is_reachable(expr):
    with pytest.raises(ConditionError):
        parse_condition(expr)


def test_the_actions_file_checks_the_rule_and_the_key_retention():
    approval = {"required": "when", "when": "amount >", "ttl_s": 60, "policy_version": "v1"}
    with pytest.raises(ActionsFileError) as exc:
        parse_actions(mutated(approval=approval), source="a.yaml", environ=ENV)
    assert "approval" in str(exc.value) and "not an expression" in str(exc.value)
    # An approval that may wait longer than the provider keeps keys is refused, with the numbers.
    slow = {"required": "always", "ttl_s": 86400, "policy_version": "v1"}
    with pytest.raises(ActionsFileError) as exc:
        parse_actions(mutated(approval=slow), source="a.yaml", environ=ENV)
    message = str(exc.value)
    assert "actions.payments.refund.create.approval.ttl_s" in message and "retention_s 86400" in message
    ok = parse_actions(mutated(approval=approval | {"when": "amount > 500"}), source="a.yaml", environ=ENV)
    assert ok.needs_approval("payments.refund.create", {"amount": "900"})
    assert not ok.needs_approval("payments.refund.create", {"amount": "12.50"})


def test_workers_check_the_approval_window_with_this_deployments_reconcile_budget():
    from outbox.errors import ConfigError
    from outbox.settings import Settings
    from workers.wiring.builders import check_approval_windows

    cfg = parse_actions(
        mutated(approval={"required": "always", "ttl_s": 3600, "policy_version": "v1"}), source="a", environ=ENV
    )
    check_approval_windows(Settings(), cfg)  # 3600 + 3600 + 720 <= 86400
    with pytest.raises(ConfigError) as exc:
        check_approval_windows(Settings(reconcile_max_lookups=1000, reconcile_max_delay_s=100), cfg)
    assert "OUTBOX_RECONCILE_MAX_LOOKUPS" in str(exc.value) and "retention_s 86400" in str(exc.value)
