"""Races on real connections: two (or more) engines released together by a threading.Barrier.

On PostgreSQL the racers really run at once (ON CONFLICT, row locks, SKIP LOCKED decide); on SQLite
writers are serialised by BEGIN IMMEDIATE + busy_timeout, so the race resolves by one waiting for
the other. Both must give the same answers.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select

from outbox.errors import IdempotencyConflict, StaleFence
from outbox.evidence.settlement import settle_if_fenced
from outbox.ledger.claims import claim_due, claim_unknown
from outbox.ledger.db import make_sessionmaker
from outbox.ledger.leases import expire_leases
from outbox.ledger.models import Attempt, Operation
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from outbox.testing import advance_ledger_clock
from producer import submit

ROUNDS = 20
JOIN_TIMEOUT_S = 30.0  # far above any lock wait here; a hang must fail the test, not the run

INTENT = dict(
    tenant="acme",
    action="payments.refund.create",
    args={"order_id": "o-1", "amount": Decimal("25.00"), "currency": "EUR"},
    subject="agent:bot",
)


def run_together(*fns: Callable[[], Any]) -> list[Any]:
    """Run each fn on its own thread, all released at once; return results (or the exception raised)."""
    barrier = threading.Barrier(len(fns), timeout=JOIN_TIMEOUT_S)
    results: list[Any] = [None] * len(fns)

    def runner(i: int, fn: Callable[[], Any]) -> None:
        try:
            barrier.wait()
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test to assert on
            results[i] = exc

    threads = [threading.Thread(target=runner, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive(), "a racer hung"
    return results


@pytest.fixture
def two_sessionmakers(ledger):
    """Two engines: every racer has its own connection pool, so nothing is shared but the database."""
    engines = [ledger.new_engine(), ledger.new_engine()]
    yield [make_sessionmaker(e) for e in engines]
    for e in engines:
        e.dispose()


def _count(ledger, stmt) -> int:
    with ledger.sessions() as s:
        return s.execute(stmt).scalar_one()


def _submit_in(sessions, **over):
    def go():
        with sessions.begin() as s:
            return submit(s, **(INTENT | over))

    return go


def test_same_key_submitted_twice_at_once_gives_one_operation(ledger, two_sessionmakers):
    a, b = two_sessionmakers
    for i in range(ROUNDS):
        key = f"wf-{i}:refund:v1"
        r1, r2 = run_together(_submit_in(a, idempotency_key=key), _submit_in(b, idempotency_key=key))
        assert not isinstance(r1, BaseException), r1
        assert not isinstance(r2, BaseException), r2
        assert r1.operation_id == r2.operation_id
        assert sorted([r1.new, r2.new]) == [False, True]
        assert _count(ledger, select(func.count()).select_from(Operation).where(Operation.idempotency_key == key)) == 1
    assert _count(ledger, select(func.count()).select_from(Operation)) == ROUNDS


def test_same_key_different_args_at_once_one_wins_one_conflicts(ledger, two_sessionmakers):
    a, b = two_sessionmakers
    for i in range(ROUNDS):
        key = f"wf-{i}:refund:v1"
        r1, r2 = run_together(
            _submit_in(a, idempotency_key=key),
            _submit_in(b, idempotency_key=key, args=INTENT["args"] | {"amount": Decimal("26.00")}),
        )
        winners = [r for r in (r1, r2) if not isinstance(r, BaseException)]
        losers = [r for r in (r1, r2) if isinstance(r, BaseException)]
        assert len(winners) == 1 and len(losers) == 1, (r1, r2)
        assert isinstance(losers[0], IdempotencyConflict), losers[0]
        assert winners[0].new and losers[0].operation_id == winners[0].operation_id
        with ledger.sessions() as s:
            stored = s.execute(select(Operation.args_digest).where(Operation.idempotency_key == key)).scalars().all()
        # The stored intent is the winner's, never a mix.
        assert stored == [winners[0].args_digest]


def test_same_key_in_two_tenants_at_once_gives_two_operations(ledger, two_sessionmakers):
    a, b = two_sessionmakers
    for i in range(ROUNDS // 2):
        key = f"wf-{i}:refund:v1"
        r1, r2 = run_together(_submit_in(a, idempotency_key=key), _submit_in(b, idempotency_key=key, tenant="globex"))
        assert r1.new and r2.new and r1.operation_id != r2.operation_id
    assert _count(ledger, select(func.count()).select_from(Operation)) == ROUNDS


def _claim_in(sessions, worker, **kw):
    def go():
        with sessions.begin() as s:
            return claim_due(s, worker=worker, lease_s=30, **kw)

    return go


def test_two_workers_claim_one_operation_exactly_one_wins(ledger, two_sessionmakers):
    a, b = two_sessionmakers
    for i in range(ROUNDS):
        with ledger.sessions.begin() as s:
            op_id = submit(s, **INTENT, idempotency_key=f"k{i}").operation_id
        # Half the rounds name the operation (a relay message), half take "whatever is due".
        kw = {"operation_id": op_id} if i % 2 else {}
        c1, c2 = run_together(_claim_in(a, "w1", **kw), _claim_in(b, "w2", **kw))
        assert not isinstance(c1, BaseException), c1
        assert not isinstance(c2, BaseException), c2
        claims = c1 + c2
        assert len(claims) == 1, (c1, c2)
        assert claims[0].operation_id == op_id and claims[0].fencing_token == 1
        assert _count(ledger, select(func.count()).select_from(Attempt).where(Attempt.operation_id == op_id)) == 1
        with ledger.sessions() as s:
            op = s.get(Operation, op_id)
        assert op.status == "dispatching" and op.fencing_token == 1 and op.attempt_count == 1
        assert op.lease_owner == claims[0].worker


def test_stale_write_is_refused_while_the_current_owners_write_lands(ledger, two_sessionmakers):
    a, b = two_sessionmakers
    for i in range(5):
        with ledger.sessions.begin() as s:
            op_id = submit(s, **INTENT, idempotency_key=f"k{i}").operation_id
        with a.begin() as s:
            [zombie] = claim_due(s, worker="zombie", lease_s=30, operation_id=op_id)
        advance_ledger_clock(ledger.engine, 30.5)  # the lease runs out on the database clock
        with ledger.sessions.begin() as s:
            assert expire_leases(s) == [op_id]
        with b.begin() as s:
            [recon] = claim_unknown(s, worker="reconciler", lease_s=30, operation_id=op_id)
        assert recon.fencing_token == zombie.fencing_token + 1

        def zombie_finalizes():
            with a.begin() as s:
                try:
                    finalize_if_fenced(
                        s,
                        zombie,
                        AttemptReport(AttemptClass.SUCCEEDED, status_code=201, provider_reference=f"re_late_{i}"),
                        to=Status.SUCCEEDED,
                        reason="2xx",
                    )
                except StaleFence as exc:
                    return exc  # caught inside the transaction: the evidence commits
            return "landed"

        def reconciler_settles():
            with b.begin() as s:
                settle_if_fenced(
                    s,
                    recon,
                    AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference=f"re_late_{i}"),
                    to=Status.SUCCEEDED,
                    reason="lookup found it",
                )
            return "landed"

        z, r = run_together(zombie_finalizes, reconciler_settles)
        assert isinstance(z, StaleFence), z
        assert r == "landed", r
        with ledger.sessions() as s:
            op = s.get(Operation, op_id)
            attempts = {x.kind: x for x in s.execute(select(Attempt).where(Attempt.operation_id == op_id)).scalars()}
        assert op.status == "succeeded" and op.fencing_token == recon.fencing_token
        assert attempts["dispatch"].stale and attempts["dispatch"].provider_reference == f"re_late_{i}"
        assert attempts["dispatch"].attempt_class == "succeeded"
        assert not attempts["lookup"].stale and attempts["lookup"].attempt_class == "succeeded"


def test_many_workers_claiming_batches_never_double_claim(pg_ledger):
    total, workers, batch = 200, 4, 5
    with pg_ledger.sessions.begin() as s:
        ids = {submit(s, **INTENT, idempotency_key=f"k{i}").operation_id for i in range(total)}
    engines = [pg_ledger.new_engine() for _ in range(workers)]
    try:

        def worker(n: int) -> Callable[[], list[str]]:
            sessions = make_sessionmaker(engines[n])

            def go() -> list[str]:
                got: list[str] = []
                while True:
                    with sessions.begin() as s:
                        claims = claim_due(s, worker=f"w{n}", lease_s=60, limit=batch)
                    if not claims:
                        return got
                    assert all(c.fencing_token == 1 for c in claims)
                    got += [c.operation_id for c in claims]

            return go

        results = run_together(*(worker(n) for n in range(workers)))
    finally:
        for e in engines:
            e.dispose()
    for r in results:
        assert not isinstance(r, BaseException), r
    claimed = [op for r in results for op in r]
    assert Counter(claimed).most_common(1)[0][1] == 1
    assert set(claimed) == ids
    with pg_ledger.sessions() as s:
        per_op = dict(s.execute(select(Attempt.operation_id, func.count()).group_by(Attempt.operation_id)).all())
        tokens = set(s.execute(select(Operation.fencing_token)).scalars())
        statuses = set(s.execute(select(Operation.status)).scalars())
    assert set(per_op) == ids and set(per_op.values()) == {1}
    assert tokens == {1} and statuses == {"dispatching"}
    # Several workers took part (SKIP LOCKED spreads the work instead of queueing on one lock).
    assert sum(1 for r in results if r) >= 2
