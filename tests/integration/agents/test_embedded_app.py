"""An application embeds the outbox in its own database, as a transactional outbox is meant to be:
the application has its own ``api`` and ``workers`` packages and its own ``runs``, ``approvals`` and
``operations`` tables, with rows in them. From its own folder (so its packages come first on the
import path) it migrates the ledger into its database and submits an intent in the same
transaction as a row of its own: both commit, or a rollback leaves neither. Its tables and rows are
as they were.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, inspect, select, text

from outbox.ledger.models import Operation
from tests.conftest import scratch_pg_database

# The application's own tables, named as applications name theirs.
APP_TABLES = {
    "runs": "CREATE TABLE runs (id INTEGER PRIMARY KEY, name VARCHAR(100) NOT NULL)",
    "approvals": "CREATE TABLE approvals (id INTEGER PRIMARY KEY, who VARCHAR(100) NOT NULL)",
    "operations": "CREATE TABLE operations (id INTEGER PRIMARY KEY, kind VARCHAR(100) NOT NULL)",
}
APP_ROWS = {
    "runs": [(1, "nightly import"), (2, "backfill")],
    "approvals": [(1, "carol")],
    "operations": [(1, "invoice")],
}

# The application's process: its engine, its sessions, its transactions.
APP = """
import sys

import api
import workers
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from outbox import migrate
from producer import submit

# Its own packages, not ours: what its imports find first.
assert api.OWNER == workers.OWNER == "app", (api.__file__, workers.__file__)

engine = create_engine(sys.argv[1])
migrate.upgrade(engine)
Session = sessionmaker(engine)
intent = dict(tenant="acme", action="payments.refund.create", subject="agent:app",
              args={"order_id": "o-1", "amount": "5.00", "currency": "EUR"})
with Session.begin() as session:
    session.execute(text("INSERT INTO runs (id, name) VALUES (3, 'refund o-1')"))
    submit(session, idempotency_key="app-1", **intent)
try:
    with Session.begin() as session:
        session.execute(text("INSERT INTO runs (id, name) VALUES (4, 'refund o-2')"))
        submit(session, idempotency_key="app-2", **intent)
        raise LookupError("the application changes its mind")
except LookupError:
    pass
print("done")
"""


@pytest.fixture(params=["sqlite", "postgres"])
def app_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The application's database, with its own tables and rows (and no ledger yet)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'app.db'}"
        _create_app_tables(url)
        yield url
        return
    with scratch_pg_database(f"outbox_test_app_{uuid.uuid4().hex[:10]}", revision="base") as url:
        _create_app_tables(url)
        yield url


def _create_app_tables(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for table, ddl in APP_TABLES.items():
            conn.execute(text(ddl))
            for row in APP_ROWS[table]:
                conn.execute(text(f"INSERT INTO {table} VALUES (:a, :b)"), {"a": row[0], "b": row[1]})
    engine.dispose()


def _app_state(engine: Engine) -> dict[str, object]:
    insp = inspect(engine)
    with engine.connect() as conn:
        return {
            table: (
                [(c["name"], str(c["type"])) for c in insp.get_columns(table)],
                [tuple(r) for r in conn.execute(text(f"SELECT * FROM {table} ORDER BY id"))],
            )
            for table in APP_TABLES
        }


def test_an_application_with_its_own_api_workers_runs_and_approvals_migrates_and_submits_in_its_transaction(
    app_database: str, tmp_path: Path
) -> None:
    app = tmp_path / "app"
    for package in ("api", "workers"):
        (app / package).mkdir(parents=True)
        (app / package / "__init__.py").write_text('OWNER = "app"\n')
    (app / "main.py").write_text(textwrap.dedent(APP))
    engine = create_engine(app_database)
    try:
        before = _app_state(engine)
        done = subprocess.run(
            [sys.executable, "main.py", app_database], cwd=app, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-3000:]
        after = _app_state(engine)
        # The application's tables are as they were, plus the one row its committed transaction wrote.
        runs_columns, runs_rows = after.pop("runs")  # type: ignore[misc]
        assert runs_rows == [*APP_ROWS["runs"], (3, "refund o-1")]
        assert (runs_columns, runs_rows[:2]) == before.pop("runs") and after == before
        with engine.connect() as conn:
            keys = conn.execute(select(Operation.idempotency_key, Operation.status)).all()
        assert keys == [("app-1", "not_dispatched")]  # the rolled-back one left nothing
    finally:
        engine.dispose()
