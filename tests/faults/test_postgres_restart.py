"""F13: PostgreSQL restarted (immediate mode, as after a crash) while workers claim and finalize.

Every claim, finalize and lookup in flight fails with "the database system is shutting down" or a
lost connection. Nothing is lost and nothing is a final failure: claimed operations come back
through lease expiry and the reconciler, unclaimed ones through the relay. So every intent must
end succeeded with one effect at the sandbox, and the workers' logs must hold no ERROR line (ERROR
is for final failures, and this run has none): an outage is one WARNING per interrupted task.
"""

from __future__ import annotations

import time

import pytest

from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.states import Status
from tests.harness import error_lines, own_pg_ledger, pipeline, pk, wait_for, whole_log_records

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"
N = 150


@pytest.fixture
def own_pipe(redis_url, sandbox, tmp_path):
    """The pipeline on a ledger whose PostgreSQL is the test's own: restarting the machine's would cut
    every other test of a parallel run."""
    with own_pg_ledger() as (url, cluster):
        engine = make_engine(url)
        try:
            with pipeline(
                db_url=url,
                sessions=make_sessionmaker(engine),
                redis_url=redis_url,
                tmp=tmp_path,
                sandbox_url=sandbox.url,
            ) as p:
                yield p, cluster
        finally:
            engine.dispose()


def test_postgres_restart_under_load_loses_nothing_and_logs_no_error(own_pipe, sandbox):
    pipe, cluster = own_pipe
    # Each call takes 50 ms, so claims and finalizes are in flight when the database goes away.
    sandbox.add_fault(mode="latency", latency_ms=50, method="POST", path=REFUNDS)
    workers = [
        pipe.start_worker("d1", queues="dispatch"),
        pipe.start_worker("d2", queues="dispatch"),
        pipe.start_worker("reconciler", queues="outcome_unknown"),
    ]
    pipe.start_relay()
    op_ids = [pipe.submit(f"f13-{i:03d}").operation_id for i in range(N)]

    wait_for(
        lambda: sum(s == Status.SUCCEEDED.value for s in (pipe.statuses(op_ids) or {}).values()) >= N // 5,
        30,
        what=f"{N // 5} of {N} settled before the restart",
    )
    cluster.stop()  # immediate mode, as after a crash
    cluster.start()
    restarted = time.monotonic()

    final = wait_for(
        lambda: (
            (st := pipe.statuses(op_ids)) is not None
            and all(
                s in (Status.SUCCEEDED.value, Status.FAILED_BEFORE_COMMIT.value, Status.RECONCILIATION_REQUIRED.value)
                for s in st.values()
            )
            and st
        ),
        90,
        interval_s=0.5,
        what="every operation settled after the restart",
    )
    assert set(final.values()) == {Status.SUCCEEDED.value}, sorted(set(final.values()))
    for i, op_id in enumerate(op_ids):
        effects = sandbox.effects(key=pk(f"f13-{i:03d}"))
        assert len(effects) == 1 and pipe.op(op_id).result_reference == effects[0]["object_id"], i
    assert sandbox.duplicates() == []
    for w in workers:
        assert w.proc.poll() is None, f"{w.name} died"
        assert error_lines(w.log(), outages=True) == [], (
            w.name,
            whole_log_records(w.log(), "WARNING", "ERROR", "CRITICAL"),
        )
    assert time.monotonic() - restarted < 90
