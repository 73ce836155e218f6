"""One ledger of two restarted mid-run (issue 35): a fleet drains ledger ``a`` (a PostgreSQL cluster
of the test's own, tests/pg_cluster.py) and ledger ``b`` (the machine's). ``a`` is stopped in
immediate mode (as after a crash) with calls in flight and kept down while ``b`` takes a new burst:
``b``'s operations must all settle while ``a`` is down. Then ``a`` comes back and every one of its
operations settles too: each exactly one effect at the provider, in both ledgers, no ERROR line in
any worker's log (a ledger outage is a WARNING per interrupted task; ERROR is for final failures).
"""

from __future__ import annotations

import time

import pytest

from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.states import Status
from producer import submit
from tests.harness import REFUND_ARGS, Pipeline, error_lines, own_pg_ledger, pk, wait_for, whole_log_records

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"
N = 150
SETTLED = {Status.SUCCEEDED.value, Status.FAILED_BEFORE_COMMIT.value, Status.RECONCILIATION_REQUIRED.value}


def _count(ledger: Pipeline, op_ids: list[str], wanted: set[str]) -> int:
    return sum(s in wanted for s in (ledger.statuses(op_ids) or {}).values())


def test_one_ledger_restarted_the_other_keeps_flowing_nothing_lost_or_doubled(pipe, sandbox):
    with own_pg_ledger() as (url_a, cluster):
        engine_a = make_engine(url_a)
        a, b = pipe.on_ledger(make_sessionmaker(engine_a)), pipe
        pipe.env["OUTBOX_DATABASE_URLS"] = f"a={url_a},b={pipe.env['OUTBOX_DATABASE_URL']}"
        pipe.env["OUTBOX_RELAY_POLL_S"] = "0.1"
        try:
            _run(a, b, cluster, sandbox)
        finally:
            pipe.stop()
            engine_a.dispose()


def _submit_at_once(ledger: Pipeline, keys: list[str]) -> list[str]:
    with ledger.sessions.begin() as session:
        return [
            submit(
                session,
                tenant="t1",
                idempotency_key=k,
                action="payments.refund.create",
                args=dict(REFUND_ARGS),
                subject="test",
            ).operation_id
            for k in keys
        ]


def _run(a: Pipeline, b: Pipeline, cluster, sandbox) -> None:
    # Each call takes 50 ms, so claims and finalizes of ledger a are in flight when it goes away.
    sandbox.add_fault(mode="latency", latency_ms=50, method="POST", path=REFUNDS)
    workers = [
        b.start_worker("d1", queues="dispatch"),
        b.start_worker("d2", queues="dispatch"),
        b.start_worker("reconciler", queues="outcome_unknown"),
    ]
    b.start_fleet_relay()
    keys = {"a": [f"lr-a-{i:03d}" for i in range(N)], "b": [f"lr-b-{i:03d}" for i in range(N)]}
    ops = {"b": [b.submit(k).operation_id for k in keys["b"]]}
    ops["a"] = _submit_at_once(a, keys["a"])  # last, in one commit: a's stop finds most of them on their way
    done = {Status.SUCCEEDED.value}
    wait_for(
        lambda: _count(a, ops["a"], done) >= N // 5,
        30,
        interval_s=0.02,
        what=f"{N // 5} of ledger a's settled before its stop",
    )

    before = _count(a, ops["a"], done)
    cluster.stop()
    down_at = time.monotonic()
    assert before < N, "ledger a had settled everything before its stop: nothing was in flight"
    assert a.statuses(ops["a"]) is None  # really down
    # A new burst on ledger b while a is down: it must all settle before a comes back.
    keys["b"] += [f"lr-b-{i:03d}" for i in range(N, 2 * N)]
    ops["b"] += [b.submit(k).operation_id for k in keys["b"][N:]]
    wait_for(lambda: _count(b, ops["b"], done) == 2 * N, 45, what="every operation of ledger b settled while a is down")
    b_settled_s = time.monotonic() - down_at
    assert a.statuses(ops["a"]) is None  # a was down all along
    time.sleep(max(0.0, 3.0 - b_settled_s))  # down at least 3 s: longer than a lease (3 s here)

    cluster.start()
    final = wait_for(
        lambda: (st := a.statuses(ops["a"])) is not None and all(s in SETTLED for s in st.values()) and st,
        90,
        interval_s=0.5,
        what="every operation of ledger a settled after its restart",
    )
    assert set(final.values()) == done, sorted(set(final.values()))
    for side, ledger in (("a", a), ("b", b)):
        for key, op_id in zip(keys[side], ops[side], strict=True):
            effects = sandbox.effects(key=pk(key))
            assert len(effects) == 1 and ledger.op(op_id).result_reference == effects[0]["object_id"], key
    assert sandbox.duplicates() == []
    for w in workers:
        assert w.proc.poll() is None, f"{w.name} died"
        assert error_lines(w.log(), outages=True) == [], (
            w.name,
            whole_log_records(w.log(), "WARNING", "ERROR", "CRITICAL"),
        )
    looked_up = sum(bool(a.attempts(op_id, "lookup")) for op_id in ops["a"])
    print(
        f"ledger a: {before}/{N} settled at its stop, {looked_up} reconciled after it; "
        f"ledger b: {2 * N} settled {b_settled_s:.1f}s after a went down"
    )
