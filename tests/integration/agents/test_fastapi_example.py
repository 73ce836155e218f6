"""The FastAPI example (examples/fastapi_async/app.py) runs offline: FastAPI's TestClient, asyncpg,
and a PostgreSQL database of its own. A request writes the service's row and the intent together; a
second request for the same order fails on the service's own constraint after submitting, and its
intent rolls back with the row."""

from __future__ import annotations

import importlib.util
import sys
from decimal import Decimal
from pathlib import Path
from types import ModuleType

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from outbox.ledger.db import make_engine
from outbox.ledger.envelope import loads_exact
from outbox.ledger.models import Operation
from tests.conftest import RUN_ID, scratch_pg_database

pytest.importorskip("fastapi")
pytest.importorskip("asyncpg")
pytestmark = pytest.mark.postgres

APP = Path(__file__).resolve().parents[3] / "examples" / "fastapi_async" / "app.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fastapi_async_example", APP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # SQLAlchemy and FastAPI read its annotations by module name
    spec.loader.exec_module(module)
    return module


def test_the_fastapi_example_commits_its_row_with_the_intent_and_rolls_both_back_together():
    from fastapi.testclient import TestClient

    example = _example()
    with scratch_pg_database(f"outbox_test_{RUN_ID}_fastapi") as url:
        app = example.create_app(make_url(url).set(drivername="postgresql+asyncpg").render_as_string(False))
        with TestClient(app) as client:
            made = client.post("/refunds", json={"request_id": "req-1", "order_id": "o-17", "amount": "25.00"})
            assert made.status_code == 201, made.text
            retried = client.post("/refunds", json={"request_id": "req-1", "order_id": "o-17", "amount": "25.00"})
            assert (retried.status_code, retried.json()) == (200, made.json())
            refused = client.post("/refunds", json={"request_id": "req-2", "order_id": "o-17", "amount": "5.00"})
            assert refused.status_code == 409 and "already has a refund request" in refused.text
            row = client.get("/refunds/req-1").json()
            assert (row["order_id"], row["amount"], row["operation_id"]) == (
                "o-17",
                "25.00",
                made.json()["operation_id"],
            )
            assert client.get("/refunds/req-2").status_code == 404

        ledger = make_engine(url)
        try:
            with Session(ledger) as s:
                ops = s.execute(select(Operation).where(Operation.tenant == "acme")).scalars().all()
            assert [(o.id, o.idempotency_key, o.status) for o in ops] == [
                (made.json()["operation_id"], "refund:req-1", "not_dispatched")
            ], "the refused request's intent rolled back with its row"
            assert loads_exact(ops[0].args) == {"order_id": "o-17", "amount": Decimal("25.00"), "currency": "EUR"}
        finally:
            ledger.dispose()
