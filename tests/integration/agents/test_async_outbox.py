"""``producer.AsyncOutbox`` on the embedded default: ``from_settings`` opens the SQLite file through
aiosqlite, and its submits are the sync ones (receipts, replays, conflicts, runs). The same on
PostgreSQL, through the pipeline: tests/integration/ledger/test_submit_drivers.py."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox import migrate
from outbox.errors import IdempotencyConflict
from outbox.ledger.db import make_engine
from outbox.ledger.models import Operation
from outbox.settings import Settings
from producer import AsyncOutbox, submit_async

pytest.importorskip("aiosqlite")

REFUND = {"order_id": "o-5", "amount": Decimal("9.90"), "currency": "EUR"}


def test_async_outbox_on_the_embedded_default_submits_through_aiosqlite(tmp_path):
    settings = Settings(data_dir=tmp_path, default_tenant="acme")
    engine = make_engine(settings.resolved_database_url)
    migrate.upgrade(engine)

    async def go() -> tuple:
        async with AsyncOutbox.from_settings(settings) as outbox:
            assert outbox.engine.dialect.driver == "aiosqlite"
            intent = dict(idempotency_key="wf-5:refund", action="payments.refund.create", subject="agent", args=REFUND)
            first = await outbox.submit(**intent)
            again = await outbox.submit(**intent | {"args": REFUND | {"amount": Decimal("9.9")}})
            with pytest.raises(IdempotencyConflict):
                await outbox.submit(**intent | {"args": REFUND | {"amount": Decimal("9.91")}})
            run = await outbox.submit_run(
                run_key="po-5", subject="agent", steps=[{"name": "order", "action": "shop.order.create", "args": {}}]
            )
            return first, again, run

    first, again, run = asyncio.run(go())
    assert (first.tenant, first.new, first.status) == ("acme", True, "not_dispatched")
    assert (again.new, again.operation_id) == (False, first.operation_id)
    with Session(engine) as s:
        keys = s.execute(select(Operation.idempotency_key, Operation.run_id).order_by(Operation.idempotency_key)).all()
    assert [tuple(k) for k in keys] == [("po-5:order", run.run_id), ("wf-5:refund", None)]
    engine.dispose()


def test_submit_async_takes_an_async_session_and_names_the_sync_call_otherwise(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'l.db'}")
    with Session(engine) as s, pytest.raises(TypeError, match="for a sync Session use submit"):
        asyncio.run(submit_async(s, tenant="t", idempotency_key="k", action="a", args={}, subject="x"))  # type: ignore[arg-type]
    engine.dispose()
