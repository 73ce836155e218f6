"""The probe's changed arguments (workers/provider/probe.py): one body argument, a free-form one first,
so that the changed request stays valid and only the provider's key check can refuse it."""

from __future__ import annotations

from workers.provider.actions import parse_actions
from workers.provider.conformance import KEY_PREFIX, probe_key
from workers.provider.probe import CHANGED_SUFFIX, changed_args, missing_args

DOC = {
    "targets": {"t": {"base_url": "http://127.0.0.1:9", "test_mode": True}},
    "actions": {
        "refund": {
            "target": "t",
            "request": {"method": "POST", "path": "/v1/orders/{order_id}/refunds"},
            "args": ["order_id", "amount", "currency", "reason", "count"],
            "decimal_args": ["amount"],
        }
    },
}


def test_a_free_form_body_argument_is_changed_never_a_path_placeholder_nor_money() -> None:
    cfg = parse_actions(DOC).action("refund")
    args = {"order_id": "o-1", "amount": "1.00", "currency": "EUR", "reason": "dup", "count": 1}
    changed, name = changed_args(args, cfg) or ({}, "")
    assert name == "reason" and changed == {**args, "reason": "dup" + CHANGED_SUFFIX}
    changed, name = changed_args({"order_id": "o-1", "amount": "1.00", "count": 1}, cfg) or ({}, "")
    assert name == "count" and changed["count"] == 2
    assert changed_args({"order_id": "o-1", "amount": "1.00"}, cfg) is None


def test_the_path_placeholders_are_required_and_keys_are_marked() -> None:
    cfg = parse_actions(DOC).action("refund")
    assert missing_args(cfg, {"amount": "1"}) == ["order_id"]
    assert probe_key().startswith(KEY_PREFIX) and probe_key() != probe_key()
