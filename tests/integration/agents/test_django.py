"""Django: a view submits inside ``transaction.atomic()`` on Django's own connection (producer.django).

The example project (examples/django_app) runs in processes of its own (tests/integration/
django_side.py: Django's global setup stays out of this process), on this run's PostgreSQL database,
beside the outbox's tables. This process holds the real relay, a Celery worker and the sandbox, and
LISTENs on the relay's channel: what Django commits is dispatched once; what it rolls back leaves no
row, no operation and no NOTIFY. Every case runs on both of Django's drivers: psycopg 3, and psycopg2
(the child cannot import psycopg, as where psycopg has no implementation: Django falls back to psycopg2
and the ledger sends its statements through SQLAlchemy).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import select

from outbox.ledger.clock import db_now
from outbox.ledger.drivers.pg_statements import NOTIFY_CHANNEL
from outbox.ledger.models import Operation, Run
from tests.conftest import _libpq
from tests.harness import pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "django_app"
SIDE = Path(__file__).with_name("django_side.py")


def _env(db_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return (
        {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
        | {"PYTHONPATH": str(EXAMPLE), "DJANGO_SETTINGS_MODULE": "refunds_site.settings", "OUTBOX_DATABASE_URL": db_url}
        | (extra or {})
    )


@pytest.fixture(scope="module")
def django_tables(pg_database_url: str) -> str:
    """The example's own table, made by its migration (`manage.py migrate`) beside the outbox's."""
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput"],
        cwd=EXAMPLE,
        env=_env(pg_database_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return pg_database_url


@pytest.fixture(params=["psycopg", "psycopg2"])
def django_pipe(request: pytest.FixtureRequest, pipe: Any, django_tables: str) -> Any:
    pipe.env["OUTBOX_DEFAULT_TENANT"] = "t1"  # the example's tenant, as Pipeline's helpers read it
    pipe.env["DJANGO_SIDE_DRIVER"] = request.param  # the driver Django runs on (django_side.py)
    with pipe.sessions() as s, s.begin():  # the example's rows of the other driver's run of the case
        s.connection().exec_driver_sql("DELETE FROM refunds_refundrequest")
    return pipe


def on_django(pipe: Any, scenario: str, settings: str = "refunds_site.settings", **kwargs: Any) -> Any:
    """Run a scenario of django_side.py in a fresh process; what it printed."""
    env = _env(
        pipe.env["OUTBOX_DATABASE_URL"],
        {k: v for k, v in pipe.env.items() if k.startswith(("OUTBOX_", "DJANGO_SIDE_"))}
        | {"DJANGO_SETTINGS_MODULE": settings, "PYTHONPATH": f"{EXAMPLE}{os.pathsep}{SIDE.parent}"},
    )
    done = subprocess.run(
        [sys.executable, str(SIDE), scenario, json.dumps(kwargs)],
        cwd=pipe.tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen.pop("django_driver") == pipe.env["DJANGO_SIDE_DRIVER"]  # the driver it was meant to run on
    return seen


@pytest.fixture
def listener(pg_ledger: Any) -> Iterator[psycopg.Connection[Any]]:
    """A LISTEN on the channel the relay listens on: every doorbell a commit rings."""
    with psycopg.connect(_libpq(pg_ledger.url), autocommit=True) as conn:
        conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        yield conn


def heard(listener: psycopg.Connection[Any], *, until: str, timeout_s: float = 10.0) -> list[str]:
    """Operation ids notified, in commit order, up to and with ``until`` (a committed one)."""
    ids = []
    for note in listener.notifies(timeout=timeout_s):
        ids.append(note.payload)
        if note.payload == until:
            break
    return ids


def rows(pipe: Any, key_prefix: str) -> list[str]:
    with pipe.sessions() as s:
        found = s.connection().exec_driver_sql(
            "SELECT idempotency_key FROM refunds_refundrequest WHERE idempotency_key LIKE %(p)s ORDER BY id",
            {"p": key_prefix + "%"},
        )
        return [r[0] for r in found]


def operations(pipe: Any, key_prefix: str) -> dict[str, Operation]:
    with pipe.sessions() as s:
        found = s.execute(select(Operation).where(Operation.idempotency_key.startswith(key_prefix))).scalars()
        return {op.idempotency_key: op for op in found}


def test_the_views_commit_is_dispatched_once_and_its_crash_leaves_nothing(django_pipe, sandbox, listener):
    pipe = django_pipe
    pipe.start_worker()
    pipe.start_relay()
    crash = {"order_id": "dj-crash", "amount": "9.00", "currency": "EUR"}
    refund = {"order_id": "dj-1", "amount": "25.00", "currency": "EUR", "reason": "damaged"}
    crashed, committed, replayed, changed = on_django(
        pipe,
        "views",
        requests=[
            ["/refunds/crash-after-submit", crash],
            ["/refunds", refund],
            ["/refunds", refund],
            ["/refunds", refund | {"amount": "26.00"}],
        ],
    )["answers"]

    assert crashed["status"] == 500, crashed
    gone = crashed["body"]["rolled_back_operation_id"]
    assert committed["status"] == 201 and committed["body"]["new"] is True, committed
    op_id = committed["body"]["operation_id"]
    # The doorbells heard, in commit order: the committed intent's, never the rolled-back one's.
    assert heard(listener, until=op_id) == [op_id]

    assert replayed["status"] == 200 and replayed["body"]["operation_id"] == op_id and not replayed["body"]["new"]
    assert changed["status"] == 409 and changed["body"]["operation_id"] == op_id, changed

    assert rows(pipe, "refund:dj-") == ["refund:dj-1:v1"]
    assert set(operations(pipe, "refund:dj-")) == {"refund:dj-1:v1"}
    with pipe.sessions() as s:
        assert s.get(Operation, gone) is None
    pipe.wait_status(op_id, "succeeded")
    # Dispatched exactly once: one request sent, one refund made.
    assert len(sandbox.requests(method="POST", key=pk("refund:dj-1:v1"))) == 1
    effects = sandbox.effects()
    assert [e["idempotency_key"] for e in effects] == [pk("refund:dj-1:v1")]


def test_the_first_submit_keeps_the_transaction_it_finds(django_pipe, listener):
    """SQLAlchemy's first connect (it initialises its dialect with a few reads) happens inside
    Django's transaction: nothing there is committed, rolled back or left changed on the connection."""
    pipe = django_pipe
    kept = on_django(pipe, "first_submit_after_a_write", order="dj-first-a")
    assert kept["row_visible"] is True
    assert kept["before"]["transaction_status"] == kept["after"]["transaction_status"] == "INTRANS"
    assert kept["after"] == kept["before"]  # Django's cursor factory and loaders came back
    if pipe.env["DJANGO_SIDE_DRIVER"] == "psycopg2":
        assert kept["before"]["typecasters"]["3802"] == "JSONB"  # Django's jsonb-as-text, set aside and back
    assert kept["after"]["in_atomic_block"] is True
    assert heard(listener, until=kept["operation_id"]) == [kept["operation_id"]]
    assert rows(pipe, "dj-first-a:") == ["dj-first-a:row"]
    assert set(operations(pipe, "dj-first-a:")) == {"dj-first-a:op"}

    rolled_back = on_django(pipe, "first_submit_then_rollback", order="dj-first-b")
    assert rows(pipe, "dj-first-b:") == [] and operations(pipe, "dj-first-b:") == {}
    with pipe.sessions() as s:
        assert s.get(Operation, rolled_back["operation_id"]) is None
    assert list(listener.notifies(timeout=0.5)) == []


def test_an_inner_atomic_rolled_back_takes_its_intent_with_it(django_pipe, listener):
    pipe = django_pipe
    ids = on_django(pipe, "inner_atomic_rolled_back", order="dj-inner")
    assert heard(listener, until=ids["kept"]) == [ids["kept"]]  # the savepoint's NOTIFY went with it
    assert rows(pipe, "dj-inner:") == ["dj-inner:row"]
    assert set(operations(pipe, "dj-inner:")) == {"dj-inner:kept"}
    with pipe.sessions() as s:
        assert s.get(Operation, ids["dropped"]) is None


def test_a_submit_outside_atomic_is_refused(django_pipe):
    pipe = django_pipe
    refused = on_django(pipe, "outside_atomic", order="dj-outside")
    assert refused["error"] == "OutsideAtomicBlock" and refused["django_kind"] is True
    assert "transaction.atomic(using='default')" in refused["message"]
    assert operations(pipe, "dj-outside:") == {}


def test_a_failed_statement_marks_the_block_for_rollback(django_pipe):
    pipe = django_pipe
    seen = on_django(pipe, "database_error_in_the_block", order="dj-failed")
    assert seen == {"error": "ReadOnlySqlTransaction", "needs_rollback": True, "after": "refused by Django"}
    assert rows(pipe, "dj-failed:") == [] and operations(pipe, "dj-failed:") == {}


def test_a_replay_answers_the_same_operation_and_changed_args_conflict(django_pipe):
    pipe = django_pipe
    seen = on_django(pipe, "replay_and_conflict", order="dj-replay")
    first, again, conflict = seen["first"], seen["again"], seen["conflict"]
    assert first["new"] is True and again["new"] is False
    assert again["operation_id"] == first["operation_id"] and again["args_digest"] == first["args_digest"]
    assert again["provider_key"] == first["provider_key"] == pk("dj-replay:replayed")
    assert conflict is not None and conflict["operation_id"] == first["operation_id"], conflict
    assert "different arguments" in conflict["message"]
    assert rows(pipe, "dj-replay:") == ["dj-replay:after-conflict"]  # the transaction went on after it
    assert set(operations(pipe, "dj-replay:")) == {"dj-replay:replayed"}


def test_an_approval_waits_quietly_and_a_run_goes_step_by_step(django_pipe, sandbox, listener):
    pipe = django_pipe
    pipe.start_worker()
    pipe.start_relay()
    seen = on_django(pipe, "approval_and_run", order="dj-run")
    assert seen["waiting"]["status"] == "awaiting_approval" and seen["waiting"]["new"] is True
    run_id = seen["run"]["run_id"]
    assert seen["run"]["new"] is True
    with pipe.sessions() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.run_key == "dj-run:run"
    refund = operations(pipe, "dj-run:run:refund")["dj-run:run:refund"]
    # The run's first step rang the doorbell; the intent awaiting approval did not.
    assert heard(listener, until=refund.id) == [refund.id]
    pipe.wait_status(refund.id, "succeeded")
    pipe.wait_status(operation_of(pipe, "dj-run:run:ticket"), "succeeded")  # made once the refund succeeded
    assert sorted(e["idempotency_key"] for e in sandbox.effects()) == [pk("dj-run:run:refund"), pk("dj-run:run:ticket")]
    assert pipe.op(seen["waiting"]["operation_id"]).status == "awaiting_approval"


def operation_of(pipe: Any, key: str) -> str:
    """The id of the operation of ``key``, once it exists."""
    return str(wait_for(lambda: (op := operations(pipe, key).get(key)) is not None and op.id, what=f"{key} exists"))


def test_the_ledger_reads_time_as_psycopg_does_whatever_djangos_time_zone_settings(django_pipe):
    """Without USE_TZ Django loads timestamps as naive local times (psycopg 3: its loader on the
    connection; psycopg2: its cursors'); the ledger reads them as the driver does for its call, so a
    run's deadline is an hour after the database's now, in any zone."""
    pipe = django_pipe
    seen = on_django(pipe, "run_with_a_deadline", settings="django_local_time", order="dj-tz")
    assert seen["django_reads_naive"] is True  # Django's own reads, after the call: naive local times
    if pipe.env["DJANGO_SIDE_DRIVER"] == "psycopg":
        assert seen["django_timestamptz_loader"] == "SpecificTzLoader"  # Django's, given back after the call
    with pipe.sessions() as s:
        run = s.get(Run, seen["run"]["run_id"])
        assert run is not None
        now = s.execute(select(db_now())).scalar_one()
        assert abs((now - run.created_at).total_seconds()) < 60, (now, run.created_at)
        assert run.deadline_at - run.created_at == dt.timedelta(hours=1)


def test_a_database_other_than_postgresql_is_refused(tmp_path):
    sqlite = f"sqlite:///{tmp_path / 'app.db'}"
    done = subprocess.run(
        [sys.executable, str(SIDE), "not_postgresql", json.dumps({"order": "dj-sqlite"})],
        cwd=tmp_path,
        env=_env(sqlite),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    refused = json.loads(done.stdout.strip().splitlines()[-1])
    assert refused["error"] == "UnsupportedDatabase"
    assert "PostgreSQL only" in refused["message"] and "sqlite" in refused["message"]
