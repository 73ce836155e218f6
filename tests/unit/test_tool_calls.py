"""The key of a tool call (producer/agents/calls.py): the host's scope, the action, and the reference or
the arguments; never per retry, never longer than a key may be; the input schema is enforced."""

from __future__ import annotations

from decimal import Decimal

import pytest

from outbox.errors import InvalidIntent
from producer.agents.calls import call_key, check_schema, exact

REFUND = "payments.refund.create"
ARGS = {"order_id": "o-81", "amount": "12.50", "currency": "EUR"}


def test_the_same_call_is_the_same_key_and_a_changed_one_is_not():
    assert call_key("conv-1", REFUND, ARGS) == call_key("conv-1", REFUND, dict(reversed(list(ARGS.items()))))
    assert call_key("conv-1", REFUND, ARGS) != call_key("conv-2", REFUND, ARGS)
    assert call_key("conv-1", REFUND, ARGS) != call_key("conv-1", REFUND, ARGS | {"amount": "12.51"})
    assert call_key("conv-1", REFUND, ARGS).startswith(f"conv-1:{REFUND}:args=")


def test_a_reference_decides_alone_and_81_is_the_order_81():
    refs = ("order_id",)
    assert call_key("c", REFUND, ARGS, refs) == 'c:payments.refund.create:ref="o-81"'
    assert call_key("c", REFUND, ARGS | {"amount": "1.00"}, refs) == call_key("c", REFUND, ARGS, refs)
    assert call_key("c", REFUND, {"order_id": 81}, refs) == call_key("c", REFUND, {"order_id": "81"}, refs)
    two = ("order_id", "line")
    assert call_key("c", REFUND, {"order_id": "a,b", "line": "c"}, two) != call_key(
        "c", REFUND, {"order_id": "a", "line": "b,c"}, two
    )
    with pytest.raises(InvalidIntent) as err:
        call_key("c", REFUND, {"amount": "1.00"}, refs)
    assert err.value.field == "args.order_id"


def test_a_long_scope_and_action_still_make_a_key_that_fits():
    key = call_key("s" * 128, "a" * 200, ARGS)
    assert len(key) <= 255 and key == call_key("s" * 128, "a" * 200, ARGS)
    assert key != call_key("s" * 127 + "t", "a" * 200, ARGS)
    for bad in ("", "   ", "x" * 129):
        with pytest.raises(InvalidIntent):
            call_key(bad, REFUND, ARGS)


def test_floats_are_read_as_the_decimals_they_were_written_as():
    assert exact({"amount": 12.5, "items": [0.1]}) == {"amount": Decimal("12.5"), "items": [Decimal("0.1")]}
    assert call_key("c", REFUND, {"amount": 12.5}) == call_key("c", REFUND, {"amount": Decimal("12.50")})


def test_the_input_schema_is_enforced_naming_the_field():
    schema = {
        "type": "object",
        "properties": {"order_id": {}, "amount": {"type": "string"}},
        "required": ["order_id"],
        "additionalProperties": False,
    }
    check_schema(schema, {"order_id": 81, "amount": "1.00"})
    for args, field in (
        ({"amount": "1.00"}, "args.order_id"),
        ({"order_id": 1, "amount": 1.5}, "args.amount"),
        ({"order_id": 1, "tip": 2}, "args.tip"),
    ):
        with pytest.raises(InvalidIntent) as err:
            check_schema(schema, args)
        assert err.value.field == field, (args, err.value)
