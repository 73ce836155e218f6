"""One worker fleet draining two ledgers (OUTBOX_DATABASE_URLS): each ledger's operations reach the
provider once, through its own relay and doorbell queues, and a doorbell for a ledger the worker
does not drain harms nothing. The restart of one ledger mid-run: tests/faults/test_ledger_restart.py."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest

from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.states import Status
from tests import spawn
from tests.conftest import RUN_ID, scratch_pg_database
from tests.harness import Pipeline, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def fleet(pipe: Pipeline) -> Iterator[tuple[Pipeline, Pipeline]]:
    """(ledger a, ledger b): b is the pipe's own database, a one of its own; the workers and the
    relay drain both."""
    with scratch_pg_database(f"outbox_test_{RUN_ID}_{uuid.uuid4().hex[:6]}") as url_a:
        engine_a = make_engine(url_a)
        pipe.env["OUTBOX_DATABASE_URLS"] = f"a={url_a},b={pipe.env['OUTBOX_DATABASE_URL']}"
        pipe.env["OUTBOX_RELAY_POLL_S"] = "0.1"
        try:
            yield pipe.on_ledger(make_sessionmaker(engine_a)), pipe
        finally:
            pipe.stop()  # before the database goes
            engine_a.dispose()


def test_one_worker_drains_two_ledgers_each_operation_once(fleet, sandbox):
    a, b = fleet
    worker = b.start_worker("both")  # -Q dispatch,outcome_unknown: every ledger's queues too
    b.start_fleet_relay()
    ops = {
        "a": [a.submit(f"fleet-a-{i}").operation_id for i in range(15)],
        "b": [b.submit(f"fleet-b-{i}").operation_id for i in range(15)],
    }
    for side, ledger in (("a", a), ("b", b)):
        for i, op_id in enumerate(ops[side]):
            op = ledger.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=30)
            effects = sandbox.effects(key=pk(f"fleet-{side}-{i}"))
            assert len(effects) == 1 and op.result_reference == effects[0]["object_id"], (side, i)
    assert sandbox.duplicates() == []
    # Each ledger's doorbells took its own queue, named in the worker's log.
    log = worker.log()
    assert "dispatch.a" in log and "dispatch.b" in log, log[-2000:]


def test_a_doorbell_for_a_ledger_the_worker_does_not_drain_is_dropped_with_an_error(fleet, sandbox):
    a, b = fleet
    op_id = a.submit("fleet-stray").operation_id
    worker = b.start_worker("both")
    from workers.engine.queues import DISPATCH_TASK
    from workers.wiring.celery_app import make_app

    # A relay of a fleet configured with a ledger "c" this worker was not given.
    make_app(b.settings()).send_task(DISPATCH_TASK, args=[[op_id]], kwargs={"ledger": "c"}, queue="dispatch")
    wait_for(lambda: "doorbell dropped" in worker.log(), 15, what="the dropped doorbell's ERROR")
    assert "names ledger 'c', and this worker drains a, b" in worker.log()
    assert a.op(op_id).status == Status.NOT_DISPATCHED.value
    assert sandbox.effects(key=pk("fleet-stray")) == []


def test_relay_once_reports_each_ledger_and_fails_for_one_it_cannot_reach(fleet, tmp_path):
    _, b = fleet
    env = dict(b.env)
    env["OUTBOX_DATABASE_URLS"] += ",down=postgresql+psycopg://postgres@127.0.0.1:1/nothing"
    done = spawn.run(
        [sys.executable, "-m", "workers.cli.main", "relay", "--once"],
        env=dict(os.environ) | env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "ledger a: expired leases: 0" in done.stdout and "ledger b: expired leases: 0" in done.stdout
    assert "ledger down: unreachable" in done.stderr
    assert "cannot reach ledger down at" in done.stderr  # the start-up WARNING names it


def test_a_doorbell_naming_no_ledger_is_outbox_database_url_s(fleet, sandbox):
    """Rung before the fleet was told of several ledgers (or by a process without
    OUTBOX_DATABASE_URLS): the worker serves it from OUTBOX_DATABASE_URL's ledger, here b."""
    _, b = fleet
    op_id = b.submit("fleet-unnamed").operation_id
    b.start_worker("both")
    from workers.engine.queues import DISPATCH_TASK
    from workers.wiring.celery_app import make_app

    make_app(b.settings()).send_task(DISPATCH_TASK, args=[[op_id]], queue="dispatch")
    b.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=15)
    assert len(sandbox.effects(key=pk("fleet-unnamed"))) == 1


def test_a_backlog_in_one_ledger_does_not_hold_back_another_s_new_intents(fleet, sandbox):
    """Ledger a holds a backlog of 1,500 intents; ledger b's 10, submitted once a is draining, settle
    while most of a's backlog still waits: b's doorbells have a queue of their own, which the
    worker takes in turn with a's (the relays bound a's queue at OUTBOX_RELAY_MAX_QUEUED)."""
    from producer import submit
    from tests.harness import REFUND_ARGS

    a, b = fleet
    with a.sessions.begin() as session:
        backlog = [
            submit(
                session,
                tenant="t1",
                idempotency_key=f"backlog-{i}",
                action="payments.refund.create",
                args=dict(REFUND_ARGS),
                subject="test",
            ).operation_id
            for i in range(1500)
        ]
    b.start_worker("both")
    b.start_fleet_relay()
    wait_for(lambda: a.count(Status.SUCCEEDED.value) >= 50, 30, what="ledger a draining")
    fresh = [b.submit(f"fresh-{i}").operation_id for i in range(10)]
    for op_id in fresh:
        b.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=30)
    left = len(backlog) - a.count(Status.SUCCEEDED.value)
    print(f"ledger a: {left} of {len(backlog)} still waiting when b's 10 had settled")
    assert left > len(backlog) // 2, f"ledger b's 10 waited for most of a's backlog ({left} left)"
    for i in range(10):
        assert len(sandbox.effects(key=pk(f"fresh-{i}"))) == 1


def test_migrate_ledgers_migrates_each_and_says_which_it_could_not_reach(fleet, tmp_path):
    _, b = fleet
    env = dict(os.environ) | b.env
    env["OUTBOX_DATABASE_URLS"] += ",down=postgresql+psycopg://postgres@127.0.0.1:1/nothing"
    done = spawn.run(
        [sys.executable, "-m", "workers.cli.main", "migrate", "--ledgers"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "ledger a at " in done.stdout and "ledger b at " in done.stdout and "schema already at" in done.stdout
    assert "ledger down: cannot reach the ledger" in done.stderr
    env.pop("OUTBOX_DATABASE_URLS")
    alone = spawn.run(
        [sys.executable, "-m", "workers.cli.main", "migrate", "--ledgers"], env=env, capture_output=True, text=True
    )
    assert alone.returncode != 0 and "--ledgers: OUTBOX_DATABASE_URLS is not set" in alone.stderr
