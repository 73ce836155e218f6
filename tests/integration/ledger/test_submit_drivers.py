"""Submit in the application's own transaction from every SQLAlchemy PostgreSQL driver, end to end.

The application has its own table (``app_refund_requests``, its own MetaData) and its own engine on
one driver: psycopg 3 and psycopg2 under a sync ``Session``, asyncpg and psycopg 3's async connection
under an ``AsyncSession`` (``producer.submit_async``). In ONE transaction it writes its row and
submits. Committed: the operation is dispatched once (effects counted at the sandbox), the row is
there, and the relay was woken (NOTIFY heard on commit). Rolled back (the application fails after
submitting): no operation, no row, no NOTIFY, nothing at the provider.

One pipeline (PostgreSQL database of this module's own, relay, one Celery worker, the sandbox) serves
every test here; each test uses keys of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, Numeric, String, create_engine, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.drivers import driver_for
from outbox.ledger.models import Operation
from producer import AsyncOutbox, Receipt, submit, submit_async
from tests.conftest import RUN_ID, scratch_pg_database
from tests.harness import REFUND_ARGS, Pipeline, pipeline, pk

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


class AppBase(DeclarativeBase):
    metadata = MetaData()  # the application's own, not the ledger's


class RefundRequest(AppBase):
    __tablename__ = "app_refund_requests"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[str] = mapped_column(String(64), unique=True)
    amount: Mapped[Decimal] = mapped_column(Numeric(12, 2))


# The application's driver: (SQLAlchemy driver name of its URL, AsyncSession).
DRIVERS = {
    "psycopg": ("postgresql+psycopg", False),
    "psycopg2": ("postgresql+psycopg2", False),
    "asyncpg": ("postgresql+asyncpg", True),
    "psycopg-async": ("postgresql+psycopg", True),
}


class AppFailed(Exception):
    """The application's own failure after it submitted: its transaction rolls back."""


@dataclass
class App:
    """An application on one driver: its engine, its table, its transaction."""

    engine: Engine | AsyncEngine
    runner: asyncio.Runner

    def refund(self, order_id: str, key: str, *, fail: bool = False) -> Receipt:
        """Write the application's row and submit the refund in one transaction (``fail``: then raise)."""
        intent: dict[str, Any] = dict(
            tenant="t1",
            idempotency_key=key,
            action="payments.refund.create",
            args=REFUND_ARGS | {"order_id": order_id},
            subject="app:refunds",
        )
        row = RefundRequest(order_id=order_id, amount=Decimal(REFUND_ARGS["amount"]))
        receipt: list[Receipt] = []
        if isinstance(self.engine, Engine):
            with sessionmaker(self.engine).begin() as s:
                s.add(row)
                receipt.append(submit(s, **intent))
                if fail:
                    raise AppFailed(key)
            return receipt[0]

        async def refund_async() -> Receipt:
            async with async_sessionmaker(self.engine).begin() as s:  # type: ignore[arg-type]
                s.add(row)
                receipt.append(await submit_async(s, **intent))
                if fail:
                    raise AppFailed(key)
            return receipt[0]

        return self.runner.run(refund_async())

    def dispose(self) -> None:
        if isinstance(self.engine, Engine):
            self.engine.dispose()
        else:
            self.runner.run(self.engine.dispose())


@dataclass
class World:
    pipe: Pipeline
    sandbox: Any
    ledger: Engine
    apps: dict[str, App]
    runner: asyncio.Runner

    def app_rows(self, order_id: str) -> int:
        with Session(self.ledger) as s:
            return int(s.execute(select(func.count()).where(RefundRequest.order_id == order_id)).scalar_one())

    def operations(self, key: str) -> int:
        with Session(self.ledger) as s:
            return int(s.execute(select(func.count()).where(Operation.idempotency_key == key)).scalar_one())


@pytest.fixture(scope="module")
def world(redis_url: str, sandbox_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with scratch_pg_database(f"outbox_test_{RUN_ID}_drivers") as url:
        ledger = make_engine(url)
        AppBase.metadata.create_all(ledger)
        sandbox_server.reset()
        tmp = tmp_path_factory.mktemp("drivers")
        sessions = make_sessionmaker(ledger)
        with (
            pipeline(
                db_url=url, sessions=sessions, redis_url=redis_url, tmp=tmp, sandbox_url=sandbox_server.url
            ) as pipe,
            asyncio.Runner() as runner,
        ):
            apps = {}
            for name, (drivername, is_async) in DRIVERS.items():
                app_url = make_url(url).set(drivername=drivername)
                apps[name] = App(create_async_engine(app_url) if is_async else create_engine(app_url), runner)
            try:
                pipe.start_worker()
                pipe.start_relay()
                yield World(pipe, sandbox_server, ledger, apps, runner)
            finally:
                for app in apps.values():
                    app.dispose()
        ledger.dispose()


def _heard(listener: Any, quiet_s: float = 0.0, want: str | None = None, timeout_s: float = 10.0) -> list[str]:
    """What the relay's own listener hears: until ``want`` arrives, or for ``quiet_s``."""
    got: list[str] = []
    deadline = time.monotonic() + (quiet_s or timeout_s)
    while time.monotonic() < deadline and (want is None or want not in got):
        got += listener.drain()
        time.sleep(0.02)
    return got


@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_the_intent_commits_with_the_applications_row_and_is_dispatched_once(world, driver):
    key, order_id = f"refund-{driver}-commit", f"o-{driver}-commit"
    listener = driver_for(world.ledger).listener(world.ledger)
    with listener.connected():
        receipt = world.apps[driver].refund(order_id, key)
        assert _heard(listener, want=receipt.operation_id) == [receipt.operation_id], "the relay is woken on commit"
    assert receipt.new and receipt.status == "not_dispatched" and receipt.provider_key == pk(key)
    op = world.pipe.wait_status(receipt.operation_id, "succeeded")
    effects = world.sandbox.effects(key=pk(key))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    assert world.app_rows(order_id) == 1


@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_a_rollback_leaves_no_intent_no_row_and_rings_no_doorbell(world, driver):
    key, order_id = f"refund-{driver}-rollback", f"o-{driver}-rollback"
    listener = driver_for(world.ledger).listener(world.ledger)
    with listener.connected():
        with pytest.raises(AppFailed):
            world.apps[driver].refund(order_id, key, fail=True)
        assert _heard(listener, quiet_s=0.5) == [], "no NOTIFY from a rolled-back submit"
    assert world.operations(key) == 0 and world.app_rows(order_id) == 0
    # The same key is free: the application's retry commits, and only that one is dispatched.
    receipt = world.apps[driver].refund(order_id, key)
    assert receipt.new
    world.pipe.wait_status(receipt.operation_id, "succeeded")
    assert len(world.sandbox.effects(key=pk(key))) == 1 and world.app_rows(order_id) == 1


def test_async_outbox_from_the_pipelines_settings_submits_an_intent_and_a_run_each_dispatched_once(world):
    """OUTBOX_DATABASE_URL is postgresql+psycopg://: AsyncOutbox opens it through psycopg's async
    connection, with the actions file's rules (provider keys)."""

    async def go() -> tuple[Receipt, Any]:
        async with AsyncOutbox.from_settings(world.pipe.settings()) as outbox:
            assert outbox.engine.dialect.driver == "psycopg" and outbox.engine.dialect.is_async
            receipt = await outbox.submit(
                tenant="t1",
                idempotency_key="refund-async-outbox",
                action="payments.refund.create",
                args=REFUND_ARGS | {"order_id": "o-async-outbox"},
                subject="app:refunds",
            )
            run = await outbox.submit_run(
                tenant="t1",
                run_key="run-async-outbox",
                subject="app:refunds",
                steps=[{"name": "refund", "action": "payments.refund.create", "args": REFUND_ARGS}],
            )
            return receipt, run

    receipt, run = world.runner.run(go())
    world.pipe.wait_status(receipt.operation_id, "succeeded")
    with Session(world.ledger) as s:
        (step,) = s.execute(select(Operation).where(Operation.run_id == run.run_id)).scalars()
    world.pipe.wait_status(step.id, "succeeded")
    for key in (receipt.provider_key, step.provider_key):
        assert len(world.sandbox.effects(key=key)) == 1
