"""Conformance: key uses (outbox/ledger/key_uses.py) are counted on every access path an application
reaches the ledger by (sync and async, each SQLAlchemy driver): a same-key replay, and a key conflict
whose caller rolled its transaction back, both counted once, outside that transaction. See
conftest.py for how to run this against a new driver."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from outbox.errors import IdempotencyConflict
from outbox.ledger.key_uses import KeyUse
from outbox.ledger.models import core_table
from outbox.reads.counters import key_uses
from producer import submit

KU = core_table(KeyUse)
ARGS = {"order_id": "o-1", "amount": "10.00"}


def _submit(args: dict[str, str]):
    return lambda s: submit(
        s, tenant="t", idempotency_key="k-1", action="payments.refund.create", args=dict(args), subject="a"
    )


def test_a_replay_and_a_rolled_back_conflict_are_each_counted_once(access):
    case = access
    assert case.within(_submit(ARGS)).new
    assert not case.within(_submit(ARGS)).new  # a same-key replay
    with pytest.raises(IdempotencyConflict):
        case.within(_submit(ARGS | {"amount": "11.00"}))  # the caller's transaction is rolled back
    assert not case.within(_submit(ARGS), commit=False).new  # a replay in a transaction rolled back
    with case.sessions() as s:  # per minute: a minute's boundary between the submits makes two rows
        counted = key_uses(s, since=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5))
        actions = set(s.execute(select(KU.c.action)).scalars())
    assert counted == {"t": {"conflicts": 1, "replays": 2}} and actions == {"payments.refund.create"}
