"""The ledger's behaviour suite: runs on SQLite (embedded default) and real PostgreSQL alike."""

from __future__ import annotations

from decimal import Decimal

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select, text, update
from sqlalchemy.exc import IntegrityError

from outbox.errors import IdempotencyConflict, IllegalTransition, InvalidIntent, StaleFence
from outbox.evidence.settlement import resolve_by_person, settle_if_fenced
from outbox.ledger.claims import claim_due, claim_unknown, extend_lease_if_fenced
from outbox.ledger.clock import db_now
from outbox.ledger.history import HistoryEvent
from outbox.ledger.leases import expire_leases
from outbox.ledger.models import OPERATIONS, Attempt, Operation
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced, request_cancel
from outbox.reads.queries import explain
from outbox.testing import advance_ledger_clock
from producer import submit

INTENT = dict(
    tenant="acme",
    idempotency_key="wf-81:invoice-17:refund-2:v1",
    action="payments.refund.create",
    args={"order_id": "o-17", "amount": Decimal("25.00"), "currency": "EUR"},
    subject="agent:support-bot",
)


def _submit(ledger, **over):
    with ledger.sessions.begin() as s:
        return submit(s, **(INTENT | over))


def _claim(ledger, worker="w1", lease_s=30.0, **kw):
    with ledger.sessions.begin() as s:
        return claim_due(s, worker=worker, lease_s=lease_s, **kw)


def _op(ledger, op_id) -> Operation:
    with ledger.sessions() as s:
        return s.get(Operation, op_id)


def _attempts(ledger, op_id) -> list[Attempt]:
    with ledger.sessions() as s:
        return list(s.execute(select(Attempt).where(Attempt.operation_id == op_id).order_by(Attempt.id)).scalars())


def test_submit_is_idempotent_by_key_and_digest(ledger):
    first = _submit(ledger)
    assert first.new and first.status == "not_dispatched"
    # Key order and number formatting do not change the intent.
    again = _submit(ledger, args={"currency": "EUR", "amount": Decimal("25"), "order_id": "o-17"})
    assert not again.new and again.operation_id == first.operation_id
    with pytest.raises(IdempotencyConflict) as info:
        _submit(ledger, args={"order_id": "o-17", "amount": Decimal("26.00"), "currency": "EUR"})
    assert info.value.operation_id == first.operation_id
    # Tenants are independent key spaces.
    other = _submit(ledger, tenant="globex")
    assert other.new and other.operation_id != first.operation_id
    with ledger.sessions() as s:
        assert s.execute(select(func.count()).select_from(Operation)).scalar_one() == 2


def test_priority_is_stored_not_digested_and_orders_the_claim(ledger):
    """A resubmit with another priority is the same intent, and keeps the first priority; within a
    tenant a higher priority is claimed before older rows (the drivers' order: tests/conformance)."""
    old = _submit(ledger, idempotency_key="p-old")
    urgent = _submit(ledger, idempotency_key="p-urgent", priority=7)
    again = _submit(ledger, idempotency_key="p-urgent", priority=-2)
    assert not again.new and again.operation_id == urgent.operation_id
    assert (_op(ledger, urgent.operation_id).priority, _op(ledger, old.operation_id).priority) == (7, 0)
    with pytest.raises(InvalidIntent, match="priority must be an integer from -100 to 100"):
        _submit(ledger, idempotency_key="p-bad", priority=500)
    assert [c.operation_id for c in _claim(ledger, limit=2)] == [urgent.operation_id, old.operation_id]


def test_a_doorbell_full_of_one_tenants_ids_leaves_room_for_anothers_due_row(ledger):
    """A worker's doorbell carries a whole batch of one tenant's ids: its claim still takes the
    other tenant's due row (the ids come first only within their own tenant)."""
    from outbox.ledger.drivers import driver_for
    from outbox.ledger.fairness import Fairness
    from workers.dispatch.batch import _claim as doorbell_claim

    with ledger.sessions.begin() as s:
        wanted = [submit(s, **(INTENT | {"idempotency_key": f"a-{n}", "delay_s": 0})).operation_id for n in range(12)]
    other = _submit(ledger, tenant="globex", idempotency_key="b-1").operation_id
    hot = driver_for(ledger.engine).hot_path(ledger.engine, ledger.sessions)
    try:
        claims = doorbell_claim(hot, "w1", 30.0, wanted[:10], 10, Fairness())
    finally:
        hot.close()
    assert len(claims) == 10 and other in {c.operation_id for c in claims}


def test_submit_in_the_callers_transaction_rolls_back_with_it(ledger):
    steps = Table("agent_steps", MetaData(), Column("id", Integer, primary_key=True), Column("note", String(50)))
    steps.create(ledger.engine, checkfirst=True)
    try:
        with pytest.raises(RuntimeError):
            with ledger.sessions.begin() as s:
                s.execute(steps.insert().values(note="refund requested"))
                submit(s, **INTENT)
                raise RuntimeError("agent crashed before commit")
        with ledger.sessions() as s:
            assert s.execute(select(func.count()).select_from(Operation)).scalar_one() == 0
            assert s.execute(select(func.count()).select_from(steps)).scalar_one() == 0
        with ledger.sessions.begin() as s:
            s.execute(steps.insert().values(note="refund requested"))
            receipt = submit(s, **INTENT)
        assert _op(ledger, receipt.operation_id) is not None
    finally:
        steps.drop(ledger.engine)


def test_bad_input_names_the_field_and_stores_nothing(ledger):
    cases = [
        (dict(idempotency_key=""), "idempotency_key"),
        (dict(tenant=" "), "tenant"),
        (dict(action="refund money"), "action"),
        (dict(args=["not", "an", "object"]), "args"),
        (dict(args={"amount": 25.0}), "args.amount"),
        (dict(args={"nested": {"rate": 0.1}}), "args.nested.rate"),
        (dict(subject=""), "subject"),
        (dict(max_attempts=0), "max_attempts"),
    ]
    for over, field in cases:
        with pytest.raises(InvalidIntent) as info:
            _submit(ledger, **over)
        assert info.value.field == field, over
    with ledger.sessions() as s:
        assert s.execute(select(func.count()).select_from(Operation)).scalar_one() == 0


def test_claim_sets_lease_token_and_attempt_row_then_finalizes(ledger):
    receipt = _submit(ledger)
    [claim] = _claim(ledger)
    assert claim.operation_id == receipt.operation_id
    assert claim.fencing_token == 1 and claim.attempt_number == 1 and not claim.open_ambiguity
    op = _op(ledger, receipt.operation_id)
    assert op.status == "dispatching" and op.lease_owner == "w1" and op.attempt_count == 1
    assert _claim(ledger, worker="w2") == []  # nothing else is due
    [attempt] = _attempts(ledger, receipt.operation_id)
    assert attempt.attempt_class == "pending" and attempt.fencing_token == 1
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s,
            claim,
            AttemptReport(AttemptClass.SUCCEEDED, status_code=201, provider_reference="re_1"),
            to=Status.SUCCEEDED,
            reason="2xx",
            result={"id": "re_1"},
        )
    op = _op(ledger, receipt.operation_id)
    assert op.status == "succeeded" and op.result_reference == "re_1" and op.finished_at is not None
    assert op.lease_owner is None
    # The receipt of a finished operation carries the stored result.
    again = _submit(ledger)
    assert again.status == "succeeded" and again.result_reference == "re_1"


def test_stale_token_is_refused_but_its_evidence_is_kept(ledger):
    receipt = _submit(ledger)
    [old] = _claim(ledger, worker="zombie", lease_s=30)
    with ledger.sessions.begin() as s:
        assert expire_leases(s) == []  # the lease still runs
    advance_ledger_clock(ledger.engine, 30.5)
    with ledger.sessions.begin() as s:
        assert expire_leases(s) == [receipt.operation_id]
    assert _op(ledger, receipt.operation_id).status == "outcome_unknown"  # never not_dispatched
    with ledger.sessions.begin() as s:
        [recon] = claim_unknown(s, worker="reconciler", lease_s=30)
    assert recon.fencing_token == old.fencing_token + 1
    # The zombie wakes up with a late 2xx: the operation row refuses it, its attempt row keeps it.
    with ledger.sessions.begin() as s:
        with pytest.raises(StaleFence):
            finalize_if_fenced(
                s,
                old,
                AttemptReport(AttemptClass.SUCCEEDED, status_code=201, provider_reference="re_late"),
                to=Status.SUCCEEDED,
                reason="2xx",
            )
    op = _op(ledger, receipt.operation_id)
    assert op.status == "outcome_unknown" and op.result_reference is None
    zombie_attempt = [a for a in _attempts(ledger, receipt.operation_id) if a.kind == "dispatch"][0]
    assert zombie_attempt.provider_reference == "re_late" and zombie_attempt.stale
    # The current owner's write lands.
    with ledger.sessions.begin() as s:
        settle_if_fenced(
            s,
            recon,
            AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_late"),
            to=Status.SUCCEEDED,
            reason="reconciled",
        )
    assert _op(ledger, receipt.operation_id).status == "succeeded"


def test_retry_waits_for_next_attempt_at_and_breaker_waits_cost_no_attempt(ledger):
    receipt = _submit(ledger)
    [c1] = _claim(ledger)
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s,
            c1,
            AttemptReport(AttemptClass.NOT_PROCESSED, status_code=503, retry_after_s=30),
            to=Status.NOT_DISPATCHED,
            reason="503",
            delay_s=30,
        )
    assert _claim(ledger) == []  # not due before Retry-After
    # Five seconds before it: still not (real time passes too, and a loaded machine took 1.25 s
    # between the finalize and this claim once, which made "a second before it" due).
    advance_ledger_clock(ledger.engine, 25)
    assert _claim(ledger) == []
    advance_ledger_clock(ledger.engine, 5.5)
    [c2] = _claim(ledger)
    assert c2.attempt_number == 2 and c2.fencing_token == 2
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s,
            c2,
            AttemptReport(AttemptClass.NOT_SENT, error="breaker open"),
            to=Status.NOT_DISPATCHED,
            reason="breaker open",
            refund_attempt=True,
        )
    assert _op(ledger, receipt.operation_id).attempt_count == 1
    # The refunded attempt keeps its row (evidence); the next claim gets the next row number.
    [c3] = _claim(ledger)
    assert (c3.attempt_number, c3.attempt_count) == (3, 2)


def _ambiguous_then_not_found(ledger, *, cannot_land: bool):
    """Attempt 1 ambiguous (502), then a lookup finds nothing: re-dispatched with the same key."""
    receipt = _submit(ledger)
    [c1] = _claim(ledger)
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s, c1, AttemptReport(AttemptClass.AMBIGUOUS, status_code=502), to=Status.OUTCOME_UNKNOWN, reason="502"
        )
    with ledger.sessions.begin() as s:
        [r1] = claim_unknown(s, worker="rec", lease_s=30)
    with ledger.sessions.begin() as s:
        settle_if_fenced(
            s,
            r1,
            AttemptReport(AttemptClass.NOT_SENT, status_code=404),
            to=Status.NOT_DISPATCHED,
            reason="authoritative 404 after settle window",
            cannot_land=cannot_land,
        )
    [c2] = _claim(ledger)
    assert c2.idempotency_key == INTENT["idempotency_key"]
    return receipt, c2


def test_not_found_fenced_off_proves_every_earlier_attempt_unable_to_land(ledger):
    # The lookup carried a newer token to a provider that fences: attempt 1 can never land now.
    receipt, c2 = _ambiguous_then_not_found(ledger, cannot_land=True)
    assert not c2.open_ambiguity and c2.proven_absent_through == 1
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s, c2, AttemptReport(AttemptClass.REJECTED, status_code=422), to=Status.FAILED_BEFORE_COMMIT, reason="422"
        )
    assert _op(ledger, receipt.operation_id).status == "failed_before_commit"


def test_not_found_without_a_fence_proves_nothing_against_a_late_landing(ledger):
    # A paused worker or the provider's queue can still deliver attempt 1 after the lookup: the
    # same key makes re-sending safe, but "no effect" stays out of reach.
    receipt, c2 = _ambiguous_then_not_found(ledger, cannot_land=False)
    assert c2.open_ambiguity and c2.proven_absent_through == 0
    with ledger.sessions.begin() as s:
        with pytest.raises(IllegalTransition):
            finalize_if_fenced(
                s,
                c2,
                AttemptReport(AttemptClass.REJECTED, status_code=422),
                to=Status.FAILED_BEFORE_COMMIT,
                reason="422",
            )
    assert _op(ledger, receipt.operation_id).status == "dispatching"


def test_failed_before_commit_is_refused_while_ambiguity_is_open(ledger):
    receipt = _submit(ledger)
    [c1] = _claim(ledger)
    # on_ambiguous: replay -> the worker schedules a replay with the same key.
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s, c1, AttemptReport(AttemptClass.AMBIGUOUS, status_code=504), to=Status.NOT_DISPATCHED, reason="replay"
        )
    [c2] = _claim(ledger)
    assert c2.open_ambiguity
    with ledger.sessions.begin() as s:
        with pytest.raises(IllegalTransition):
            finalize_if_fenced(
                s,
                c2,
                AttemptReport(AttemptClass.NOT_PROCESSED, status_code=503),
                to=Status.FAILED_BEFORE_COMMIT,
                reason="budget spent",
            )
    assert _op(ledger, receipt.operation_id).status == "dispatching"
    with pytest.raises(IllegalTransition):
        with ledger.sessions.begin() as s:
            finalize_if_fenced(s, c2, AttemptReport(AttemptClass.AMBIGUOUS), to=Status.FAILED_BEFORE_COMMIT, reason="x")


def test_reconciliation_required_and_person_resolution(ledger):
    receipt = _submit(ledger)
    [c1] = _claim(ledger)
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s,
            c1,
            AttemptReport(AttemptClass.AMBIGUOUS, error="read timeout"),
            to=Status.OUTCOME_UNKNOWN,
            reason="timeout",
        )
    with ledger.sessions.begin() as s:
        [r] = claim_unknown(s, worker="rec", lease_s=30)
        assert claim_unknown(s, worker="rec2", lease_s=30) == []  # leased
    with ledger.sessions.begin() as s:
        settle_if_fenced(
            s,
            r,
            AttemptReport(AttemptClass.AMBIGUOUS, status_code=503),
            to=Status.RECONCILIATION_REQUIRED,
            reason="lookup down",
        )
    with ledger.sessions.begin() as s:
        assert (
            resolve_by_person(s, receipt.operation_id, outcome="not-executed", by="alice", note="checked dashboard")
            is Status.NOT_DISPATCHED
        )
    [c2] = _claim(ledger)
    assert c2.attempt_number == 2 and not c2.open_ambiguity
    with ledger.sessions() as s:
        history = explain(s, receipt.operation_id).as_json()["history"]
    assert any(e["actor"] == "alice" and e["reason"] == "checked dashboard" for e in history)


def test_cancel(ledger):
    r1 = _submit(ledger)
    with ledger.sessions.begin() as s:
        assert request_cancel(s, r1.operation_id, actor="bob") is Status.CANCELLED
    assert _claim(ledger) == []
    r2 = _submit(ledger, idempotency_key="k2")
    [c] = _claim(ledger)
    with ledger.sessions.begin() as s:
        assert request_cancel(s, r2.operation_id, actor="bob", reason="customer withdrew") is Status.DISPATCHING
    # The history says who asked, when and why, although the cancel could not take effect (issue 15).
    with ledger.sessions() as s:
        asked = [e for e in explain(s, r2.operation_id).as_json()["history"] if e["event"] == "cancel requested"]
    assert len(asked) == 1 and asked[0]["actor"] == "bob" and asked[0]["at"]
    assert asked[0]["from"] == asked[0]["to"] == "dispatching"
    assert asked[0]["reason"].startswith("customer withdrew; a request is in flight")
    # A late success after a cancel request is still recorded as success.
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s, c, AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_9"), to=Status.SUCCEEDED, reason="2xx"
        )
    op = _op(ledger, r2.operation_id)
    assert op.status == "succeeded" and op.cancel_requested


def test_claims_in_batches_take_due_rows_in_order(ledger):
    ids = [_submit(ledger, idempotency_key=f"k{i}").operation_id for i in range(5)]
    with ledger.sessions.begin() as s:
        s.execute(update(Operation).where(Operation.id == ids[4]).values(next_attempt_at=db_now(60)))
    claims = _claim(ledger, limit=10)
    assert sorted(c.operation_id for c in claims) == sorted(ids[:4])
    with ledger.sessions.begin() as s:
        assert extend_lease_if_fenced(s, claims[0], lease_s=60)


def test_every_transition_is_in_the_history(ledger):
    receipt = _submit(ledger)
    [c] = _claim(ledger)
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s, c, AttemptReport(AttemptClass.NOT_PROCESSED, status_code=429), to=Status.NOT_DISPATCHED, reason="429"
        )
    with ledger.sessions() as s:
        events = (
            s.execute(
                select(HistoryEvent.to_status)
                .where(HistoryEvent.operation_id == receipt.operation_id)
                .order_by(HistoryEvent.id)
            )
            .scalars()
            .all()
        )
    assert events == ["not_dispatched", "dispatching", "not_dispatched"]


def test_schema_refuses_unknown_status(ledger):
    _submit(ledger)
    with pytest.raises(IntegrityError):  # the CHECK constraint, on both backends
        with ledger.sessions.begin() as s:
            s.execute(text(f"UPDATE {OPERATIONS} SET status = 'done'"))


def test_submit_notifies_the_relay_on_commit_only(pg_ledger):
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(pg_ledger.url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN outbox_due")
        with pytest.raises(RuntimeError):
            with pg_ledger.sessions.begin() as s:
                submit(s, **(INTENT | {"idempotency_key": "rolled-back"}))
                raise RuntimeError("agent crashed")
        with pg_ledger.sessions.begin() as s:
            receipt = submit(s, **INTENT)
            assert not list(listener.notifies(timeout=0.2)), "NOTIFY must wait for the commit"
        got = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
        assert got == [receipt.operation_id]
        with pg_ledger.sessions.begin() as s:
            assert not submit(s, **INTENT).new  # a replay inserts nothing and notifies nothing
        assert not list(listener.notifies(timeout=0.3))


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"idempotency_key": "k\x00ey"}, "idempotency_key"),
        ({"run_id": "r\ud800"}, "run_id"),
        ({"args": {"note": "lone \udc00 surrogate"}}, "args"),
        ({"deadline_s": 1.7e308}, "deadline_s"),
        ({"delay_s": float("inf")}, "delay_s"),
    ],
)
def test_text_and_times_the_database_cannot_hold_are_refused_with_the_field(ledger, over, field):
    # Found by the API's schema fuzzing (issue 16): each was a database error (HTTP 500), not a 422.
    with pytest.raises(InvalidIntent) as exc:
        _submit(ledger, **over)
    assert exc.value.field == field


@pytest.mark.parametrize(
    "to, report, recheck_s",
    [
        (Status.SUCCEEDED, AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_1"), 0.0),
        (Status.NOT_DISPATCHED, AttemptReport(AttemptClass.NOT_SENT, status_code=404, error="not found"), 0.0),
        (Status.OUTCOME_UNKNOWN, AttemptReport(AttemptClass.AMBIGUOUS, status_code=503, error="lookup down"), 7.0),
    ],
)
def test_batched_settlements_write_what_one_settlement_writes(ledger, to, report, recheck_s):
    """The reconciler settles a batch in one statement per operation (settle_many_if_fenced, issue
    14); the rows it leaves must be those settle_if_fenced leaves, and a stale member of the batch
    is refused alone, its lookup kept as evidence."""
    from outbox.evidence.settlement import SettlementMove, settle_many_if_fenced

    ids = [_submit(ledger, idempotency_key=f"batch-{n}").operation_id for n in range(3)]
    claims = _claim(ledger, limit=3)
    with ledger.sessions.begin() as s:
        for c in claims:
            finalize_if_fenced(
                s, c, AttemptReport(AttemptClass.AMBIGUOUS, status_code=502), to=Status.OUTCOME_UNKNOWN, reason="502"
            )
    with ledger.sessions.begin() as s:
        lookups = {c.operation_id: c for c in claim_unknown(s, worker="rec", lease_s=30, limit=3)}
    one, batched, stolen = (lookups[i] for i in ids)
    with ledger.sessions.begin() as s:  # someone else takes the third: its token moves on
        s.execute(update(Operation).where(Operation.id == stolen.operation_id).values(fencing_token=99))
    result = {"id": "re_1"} if to is Status.SUCCEEDED else None
    with ledger.sessions.begin() as s:
        settle_if_fenced(s, one, report, to=to, reason="looked up", recheck_in_s=recheck_s, result=result)
    with ledger.sessions.begin() as s:
        refusals = settle_many_if_fenced(
            s, [SettlementMove(c, report, to, "looked up", recheck_s, result) for c in (batched, stolen)]
        )
    assert refusals[0] is None and isinstance(refusals[1], StaleFence)

    def row(op_id):
        op = _op(ledger, op_id)
        wait = (op.next_attempt_at - op.updated_at).total_seconds()
        with ledger.sessions() as s:
            events = s.execute(
                select(HistoryEvent.from_status, HistoryEvent.to_status, HistoryEvent.event, HistoryEvent.reason)
                .where(HistoryEvent.operation_id == op_id)
                .order_by(HistoryEvent.id)
            ).all()
        [lookup] = [a for a in _attempts(ledger, op_id) if a.kind == "lookup"]
        return (
            op.status,
            op.reason,
            op.waiting_for,
            op.lease_owner,
            op.lease_expires_at,
            op.result_reference,
            op.result_digest,
            op.result,
            op.error_class,
            op.last_error,
            op.finished_at is not None,
            round(wait) if to is not Status.SUCCEEDED else None,
            [tuple(e) for e in events],
            (lookup.attempt_class, lookup.status_code, lookup.error, lookup.ended_at is not None, lookup.stale),
        )

    assert row(batched.operation_id) == row(one.operation_id)
    assert row(one.operation_id)[0] == to.value
    kept = _op(ledger, stolen.operation_id)
    assert kept.status == "outcome_unknown" and kept.fencing_token == 99
    [evidence] = [a for a in _attempts(ledger, stolen.operation_id) if a.kind == "lookup"]
    assert evidence.stale and evidence.attempt_class == report.klass.value


def test_a_backlog_gets_fresh_planner_statistics_and_pk_plans(pg_ledger):
    """Issue 14: the hot statements run on cached generic plans; planned on a nearly empty table, a
    doorbell's read of ten ids scanned the whole partial index of due rows (3 ms per claim under a
    10,000-row backlog). The relay's sweep analyzes a queue table that changed enough, and the
    next execution is planned on the new statistics: ten ids are found through the primary key."""
    import psycopg
    from sqlalchemy.engine import make_url

    from outbox.ledger.drivers import pg_statements as sql
    from outbox.ledger.planner_stats import PlannerStats

    with pg_ledger.engine.begin() as conn:
        conn.execute(text(f"ANALYZE {OPERATIONS}"))  # analyzed while empty, as on a new deployment
    with pg_ledger.sessions.begin() as s:
        for n in range(3000):
            submit(s, **(INTENT | {"idempotency_key": f"backlog-{n}"}))
    url = make_url(pg_ledger.url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:

        def plan() -> str:
            ids = [r[0] for r in conn.execute(f"SELECT id FROM {OPERATIONS} ORDER BY random() LIMIT 10")]
            return "\n".join(r[0] for r in conn.execute(f"EXPLAIN {sql.READ_DUE}", {"ids": ids}))

        # The trap: planned as if the backlog were not there. Not asserted: PostgreSQL scales the
        # empty table's statistics by its current size, and once in five full-suite runs
        # (2026-12-02, CI on a clean clone) that estimate found the primary key on its own. What
        # must hold is below: the sweep analyzes the changed table, and the plan uses the key.
        print("before the refresh:", "primary key" if f"pk_{OPERATIONS}" in plan() else "the trap")
        stats = PlannerStats(pg_ledger.engine, min_interval_s=0)
        assert OPERATIONS in wait_for_stats(stats, OPERATIONS)
        assert f"pk_{OPERATIONS}" in plan(), plan()
        assert OPERATIONS not in stats.refresh_if_stale()  # nothing changed since: not analyzed again


def test_the_relays_later_analyses_cover_the_searched_columns_and_count_from_its_own_mark(pg_ledger, monkeypatch):
    """Issue 35: a whole-table ANALYZE every few seconds was 13% of the database's CPU while a young
    ledger grows, most of it the wide text columns no plan reads. A relay's first analysis of a table
    covers every column; the next ones only the columns its indexes key or filter on (``tenant`` is
    one, ``subject`` is not), and every column again after ALL_COLUMNS_EVERY_S. Such an analysis
    leaves PostgreSQL's count of changes as it was: counted from the relay's own mark, a table
    unchanged since is not analyzed again (else it would be, at every sweep)."""
    from outbox.ledger import planner_stats
    from outbox.ledger.planner_stats import PlannerStats

    monkeypatch.setattr(planner_stats, "MIN_CHANGED_ROWS", 100)
    monkeypatch.setattr(planner_stats, "MIN_CHANGED_SHARE", 0.0)  # earlier tests' rows may still be counted
    stats = PlannerStats(pg_ledger.engine, min_interval_s=0)
    added = 0

    def add(n: int, value: str) -> None:
        nonlocal added
        with pg_ledger.engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO {OPERATIONS} (id, tenant, idempotency_key, action, args, args_digest, subject,"
                    " status, fencing_token, attempt_count, next_attempt_at, cancel_requested,"
                    " proven_absent_through, created_at, updated_at)"
                    " SELECT 'stats-' || g, :v, 'stats-' || g, 'refund', '{}', md5(g::text), :v, 'not_dispatched',"
                    " 0, 0, now(), false, 0, now(), now() FROM generate_series(CAST(:a AS int), CAST(:b AS int)) AS g"
                ),
                {"v": value, "a": added, "b": added + n - 1},
            )
            # Counted when this backend next goes idle, not up to 10 s later (PostgreSQL 15).
            conn.execute(text("SELECT pg_stat_force_next_flush()"))
        added += n

    def common(column: str) -> set[str]:
        with pg_ledger.engine.connect() as conn:
            row = conn.execute(
                text("SELECT most_common_vals::text::text[] FROM pg_stats WHERE tablename = :t AND attname = :c"),
                {"t": OPERATIONS, "c": column},
            ).first()
        return set(row[0] or []) if row else set()

    add(500, "first")
    assert OPERATIONS in wait_for_stats(stats, OPERATIONS)  # every column
    assert common("tenant") == common("subject") == {"first"}
    add(1500, "second")
    assert OPERATIONS in wait_for_stats(stats, OPERATIONS)  # the searched ones
    assert "second" in common("tenant") and common("subject") == {"first"}
    assert OPERATIONS not in stats.refresh_if_stale(), "unchanged since the relay's mark: not analyzed again"
    monkeypatch.setattr(planner_stats, "ALL_COLUMNS_EVERY_S", 0.0)
    add(1500, "third")
    assert OPERATIONS in wait_for_stats(stats, OPERATIONS)
    assert "third" in common("subject")


def test_a_doorbells_finalize_finds_its_attempt_rows_by_key_at_any_table_size(pg_ledger):
    """Issue 35: the multi-row finalize reads its rows from one JSON text, which PostgreSQL counts as
    100 rows when it plans; with 20,000 attempt rows (fresh statistics) a scan of the whole table
    looked cheaper than 100 index probes, and every doorbell's finalize read it (1.7 ms a statement,
    growing with the table until ~30,000 rows). The attempt ids passed again as an array let the
    planner count ten rows and use the primary key. (EXPLAIN with values plans for those values;
    the generic plan the statement runs on prices an array parameter at ten elements too.)"""
    import json

    import psycopg
    from sqlalchemy.engine import make_url

    from outbox.ledger.drivers import pg_moves
    from outbox.ledger.models import ATTEMPTS

    _grow(pg_ledger, 1, 20_000, attempts=True, status="dispatching", attempt_class="pending")
    with pg_ledger.engine.begin() as conn:
        conn.execute(text(f"ANALYZE {OPERATIONS}"))
        conn.execute(text(f"ANALYZE {ATTEMPTS}"))
    url = make_url(pg_ledger.url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        picked = conn.execute(f"SELECT operation_id, id FROM {ATTEMPTS} ORDER BY random() LIMIT 10").fetchall()
        rows = [
            {name: None for name, _ in pg_moves.FINALIZE_COLUMNS}
            | {"operation_id": op_id, "token": 1, "attempt_id": attempt_id, "to": "succeeded", "stale": False}
            for op_id, attempt_id in picked
        ]
        params = {"rows": json.dumps(rows), "ids": [r[0] for r in picked], "attempt_ids": [r[1] for r in picked]}
        plan = "\n".join(
            r[0] for r in conn.execute("EXPLAIN " + pg_moves.finalize_rows(Status.SUCCEEDED, False), params)
        )
    assert f"Seq Scan on {ATTEMPTS}" not in plan, plan
    assert f"Seq Scan on {OPERATIONS}" not in plan, plan


def test_claims_and_finalizes_run_on_their_generic_plans_and_leave_the_setting_as_it_was(pg_ledger):
    """Issue 35: planning a claim costs more than running it, and PostgreSQL, left to choose, planned
    it (and the doorbell's multi-row finalize) afresh for most calls in some runs. The driver runs
    both with plan_cache_mode force_generic_plan: once psycopg has prepared them (after five runs),
    PostgreSQL plans them no more (pg_prepared_statements counts no custom plan; it would count
    five before choosing). The transaction's setting is back to its default after each."""
    from outbox.ledger.db import make_engine, make_sessionmaker
    from outbox.ledger.transitions import Finalize, finalize_many_if_fenced

    for n in range(24):
        _submit(pg_ledger, idempotency_key=f"generic-{n}")
    engine = make_engine(pg_ledger.url, pool_size=1, max_overflow=0)  # one connection: its prepared statements
    sessions = make_sessionmaker(engine)
    report = AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_1")
    try:
        for _ in range(12):
            with sessions.begin() as s:
                claims = claim_due(s, worker="w", lease_s=30.0, limit=2)
                assert len(claims) == 2
                assert s.execute(text("SHOW plan_cache_mode")).scalar_one() == "auto"
                assert s.execute(text("SHOW random_page_cost")).scalar_one() == "4"
            with sessions.begin() as s:
                items = [Finalize(c, report, Status.SUCCEEDED, "done") for c in claims]
                assert finalize_many_if_fenced(s, items) == [None, None]
                assert s.execute(text("SHOW plan_cache_mode")).scalar_one() == "auto"
                assert s.execute(text("SHOW random_page_cost")).scalar_one() == "4"
        with sessions() as s:
            plans = s.execute(
                text(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                    f" WHERE statement LIKE '%UPDATE {OPERATIONS} o SET%' OR statement LIKE '%json_to_recordset%'"
                )
            ).all()
    finally:
        engine.dispose()
    assert len(plans) == 2, plans  # the claim, the finalize of two alike moves
    assert all(custom == 0 and generic >= 1 for generic, custom in plans), plans


def test_a_claim_on_the_workers_autocommit_connection_plans_generically_and_quietly(pg_ledger):
    """The worker's hot path claims (and reads what is due, and the attempt log) on its own
    autocommit connection (LedgerConnection, PgHotPath): the set, the statement and the set back
    are one implicit transaction there. No warning (SET LOCAL would log one per claim), the
    generic plans used, nothing left set on the connection (a session-wide SET would reach other
    clients behind a transaction-pooling PgBouncer), and a setting of a caller's transaction kept."""
    from outbox.ledger.claims import read_due
    from outbox.ledger.drivers import driver_for
    from outbox.ledger.hot_path import LedgerConnection

    for n in range(14):
        _submit(pg_ledger, idempotency_key=f"quiet-{n}")
    ledger = LedgerConnection(pg_ledger.engine, pg_ledger.sessions)
    notices: list[str] = []
    try:
        with ledger.one_statement() as conn:
            conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            ids = [r[0] for r in conn.execute(f"SELECT id FROM {OPERATIONS} ORDER BY id LIMIT 3")]
        for _ in range(12):
            with ledger.one_statement() as conn:
                assert len(claim_due(conn, worker="w", lease_s=30.0, limit=1)) == 1
            with ledger.one_statement() as conn:
                read_due(conn, ids)  # the doorbell's first read
            with ledger.transaction() as conn:
                driver_for(conn).attempt_log(conn, ids, ("id", "operation_id"))  # the evidence's read
        with ledger.one_statement() as conn:
            assert conn.execute("SHOW plan_cache_mode").fetchone() == ("auto",)
            assert conn.execute("SHOW random_page_cost").fetchone() == ("4",)
            plans = conn.execute(  # this read is prepared at once too, and its text matches: not counted
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                f" WHERE (statement LIKE '%UPDATE {OPERATIONS} o SET%' OR statement LIKE '%= ANY(%')"
                " AND statement NOT LIKE '%pg_prepared_statements%'"
            ).fetchall()
        assert len(plans) == 3, plans  # the claim, the due read, the attempt log
        assert all(custom == 0 and generic >= 1 for generic, custom in plans), plans
        with ledger.transaction() as conn:
            conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            conn.execute("SET LOCAL random_page_cost = 2.5")
            assert len(claim_due(conn, worker="w", lease_s=30.0, limit=1)) == 1
            assert conn.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)
            assert conn.execute("SHOW random_page_cost").fetchone() == ("2.5",)
    finally:
        ledger.close()
    assert notices == []


def wait_for_stats(stats, table):
    """Refreshes until ``table`` was analyzed; returns every table analyzed on the way. The activity
    counters reach pg_stat_user_tables within about a second of a commit. Another queue table may come
    along: the session's tests share one ledger database (truncated between them), and an earlier
    test's attempt writes reached the counters only now in a CI run (['outbox_operations',
    'outbox_attempts'])."""
    import time

    done: list[str] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and table not in done:
        done += stats.refresh_if_stale()
        if table not in done:
            time.sleep(0.2)
    return done


@pytest.fixture
def lone_pg_ledger():
    """A PostgreSQL ledger in a database of its own: no read of another test can hold back the
    horizon that decides when a dead index entry may be marked (one left idle in a transaction in the
    process's shared database would keep every entry alive). A writing transaction in any database
    still can: the test that counts on the marking waits for those to end."""
    import uuid

    from outbox.ledger.db import make_engine, make_sessionmaker
    from tests.conftest import Ledger, scratch_pg_database
    from tests.harness import record_moves

    with scratch_pg_database(f"outbox_test_lone_{uuid.uuid4().hex[:8]}") as url:
        engine = make_engine(url)
        yield Ledger("postgres", url, engine, make_sessionmaker(engine))
        record_moves(engine)
        engine.dispose()


def _no_autovacuum(ledger) -> None:
    from outbox.ledger.models import ATTEMPTS

    with ledger.engine.begin() as conn:
        for table in (OPERATIONS, ATTEMPTS):
            conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = off)"))


def _grow(
    ledger, first: int, n: int, *, attempts: bool = False, status: str = "succeeded", attempt_class: str = "succeeded"
) -> None:
    """``n`` operations (``bulk-<first>``...) in ``status``, token 1, with an attempt each of
    ``attempt_class`` if ``attempts``, in one statement each; counted in the activity statistics
    when this backend next goes idle."""
    from outbox.ledger.models import ATTEMPTS

    span = {"a": first, "b": first + n - 1, "status": status, "class": attempt_class}
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {OPERATIONS} (id, tenant, idempotency_key, action, args, args_digest, subject, status,"
                " reason, fencing_token, attempt_count, max_attempts, next_attempt_at, cancel_requested,"
                " proven_absent_through, created_at, updated_at)"
                " SELECT 'bulk-' || g, 't', 'bulk-' || g, 'refund', '{}', md5(g::text), 's', :status, 'r', 1, 1,"
                " 5, now(), false, 0, now(), now() FROM generate_series(CAST(:a AS int), CAST(:b AS int)) AS g"
            ),
            span,
        )
        if attempts:
            conn.execute(
                text(
                    f"INSERT INTO {ATTEMPTS} (operation_id, attempt_number, kind, fencing_token, worker, started_at,"
                    " attempt_class, stale) SELECT 'bulk-' || g, 1, 'dispatch', 1, 'w', now(), :class, false"
                    " FROM generate_series(CAST(:a AS int), CAST(:b AS int)) AS g"
                ),
                span,
            )
        conn.execute(text("SELECT pg_stat_force_next_flush()"))


def test_a_young_ledgers_claims_and_finalizes_keep_finding_rows_by_key_as_its_tables_grow(lone_pg_ledger):
    """Issue 56: the hot path runs on generic plans made at its first executions, on a new ledger's
    tables of a few hundred rows. Priced with PostgreSQL's default random page cost, ten probes of
    the primary key looked dearer than reading such a table whole: the claim's update read every
    operation row and the finalize every attempt row, and kept doing so as the tables grew, until an
    ANALYZE made them re-plan (0.5 ms a claim at 1,000 rows; the first ~1,500 operations of a
    benchmark). Planned at 300 operations and 100 attempts, they must read neither table whole
    once each holds 20,000 more."""
    from outbox.ledger.db import make_engine, make_sessionmaker
    from outbox.ledger.models import ATTEMPTS
    from outbox.ledger.transitions import Finalize, finalize_many_if_fenced

    ledger = lone_pg_ledger
    _no_autovacuum(ledger)  # no ANALYZE but the test's (a compose PostgreSQL runs autovacuum)
    with ledger.sessions.begin() as s:
        for n in range(300):
            submit(s, **(INTENT | {"idempotency_key": f"young-{n}"}))
    engine = make_engine(ledger.url, pool_size=1, max_overflow=0)  # one connection: its prepared statements
    sessions = make_sessionmaker(engine)
    report = AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_1")
    count = text(
        f"SELECT pg_stat_get_xact_numscans('{OPERATIONS}'::regclass), pg_stat_get_xact_numscans('{ATTEMPTS}'::regclass)"
    )
    try:

        def claim_and_finalize() -> list[tuple[int, int]]:
            """The whole-table reads (sequential scans) of each table by a claim of two, then by their
            finalize (this backend's counts not yet flushed to the shared statistics, before and after)."""
            with sessions.begin() as s:
                before = s.execute(count).one()
                claims = claim_due(s, worker="w", lease_s=30.0, limit=2)
                assert len(claims) == 2
                claimed = s.execute(count).one()
            with sessions.begin() as s:
                finalize_many_if_fenced(s, [Finalize(c, report, Status.SUCCEEDED, "done") for c in claims])
                finalized = s.execute(count).one()
            return [tuple(b - a for a, b in zip(x, y)) for x, y in ((before, claimed), (claimed, finalized))]

        for _ in range(50):  # 100 attempts
            claim_and_finalize()
        with ledger.engine.begin() as conn:  # a young ledger's statistics, as the relay's first ANALYZE leaves them
            conn.execute(text(f"ANALYZE {OPERATIONS}"))
            conn.execute(text(f"ANALYZE {ATTEMPTS}"))
        for _ in range(2):  # the generic plans made again, at 300 operations and 104 attempts
            claim_and_finalize()
        _grow(ledger, 0, 20_000, attempts=True)
        assert claim_and_finalize() == [(0, 0), (0, 0)]
    finally:
        engine.dispose()


def test_a_young_table_is_analyzed_each_time_it_doubles_and_looked_at_every_sweep_until_grown(
    lone_pg_ledger, monkeypatch
):
    """Issue 56: the relay analyzed a queue table once 1,000 of its rows and a fifth had changed, and
    looked every 5 s: a new ledger's first ANALYZE came ~4 s into a benchmark, its claims planned on
    an empty table until then. A young table (under YOUNG_ROWS rows when last analyzed) is analyzed
    each time it has doubled since, however few rows changed, and looked at every sweep; once both
    tables are grown, the interval holds again."""
    import time

    from outbox.ledger import planner_stats
    from outbox.ledger.models import ATTEMPTS
    from outbox.ledger.planner_stats import PlannerStats
    from tests.harness import wait_for

    monkeypatch.setattr(planner_stats, "YOUNG_FIRST_ROWS", 100)
    monkeypatch.setattr(planner_stats, "YOUNG_ROWS", 1_000)
    _no_autovacuum(lone_pg_ledger)
    stats = PlannerStats(lone_pg_ledger.engine, min_interval_s=3600)  # the interval alone: one look an hour
    assert stats.refresh_if_stale() == []  # empty: nothing to analyze
    _grow(lone_pg_ledger, 0, 150)
    assert OPERATIONS in wait_for_stats(stats, OPERATIONS)  # 150 rows changed, not 1,000: young
    _grow(lone_pg_ledger, 150, 100)  # 250 < twice 150
    with lone_pg_ledger.engine.begin() as conn:  # 1,000 rows changed: the other rules' looks wait their interval
        for _ in range(4):
            conn.execute(text(f"UPDATE {OPERATIONS} SET updated_at = now()"))
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
    time.sleep(1.5)
    assert OPERATIONS not in stats.refresh_if_stale()

    def analyzed_both() -> None:
        since = len(stats.analyzed)

        def both() -> bool:
            stats.refresh_if_stale()
            return {OPERATIONS, ATTEMPTS} <= set(stats.analyzed[since:])

        # The activity counters arrive within about a second.
        wait_for(both, 10, interval_s=0.2, what=lambda: f"both tables analyzed: {stats.analyzed[since:]}")

    _grow(lone_pg_ledger, 250, 100, attempts=True)  # 350 >= twice 150; the attempts table's first 100
    analyzed_both()
    _grow(lone_pg_ledger, 350, 1_500, attempts=True)  # both past YOUNG_ROWS once analyzed: grown up
    analyzed_both()
    time.sleep(1.5)  # the analyses' own counts arrive; unchanged since, and as many rows as analyzed
    stats.min_interval_s = 0
    assert stats.refresh_if_stale() == []  # (with the partial ANALYZE's row count: else "doubled" again)
    stats.min_interval_s = 3600
    _grow(lone_pg_ledger, 1_850, 5_000, attempts=True)  # stale by any rule, but the interval holds now
    time.sleep(1.5)
    assert stats.refresh_if_stale() == []


def _older_than(conn, xid: int) -> list[tuple[object, ...]]:
    """The server's sessions and prepared transactions older than ``xid`` (a full, 64-bit id; the
    views show 32-bit ones, compared within this epoch): database, pid or gid, state, query."""
    rows = conn.execute(
        "SELECT datname, pid::text, state, left(query, 80) FROM pg_stat_activity"
        " WHERE backend_xid::text::bigint < %(x)s OR backend_xmin::text::bigint < %(x)s"
        " UNION ALL SELECT database, gid, 'prepared', prepared::text FROM pg_prepared_xacts"
        " WHERE transaction::text::bigint < %(x)s",
        {"x": xid % 2**32},
    ).fetchall()
    conn.commit()
    return rows


def test_a_claim_of_any_due_rows_skips_the_entries_its_predecessors_left(lone_pg_ledger):
    """Issue 14: every claim moves its rows out of the partial index of due rows, and their
    entries stay until VACUUM. Bounded by clock_timestamp() (VOLATILE: no index condition), a claim
    of "whatever is due" read the whole index through a bitmap scan, dead entries and their heap
    pages included, every time: 1.6 ms and ~500 pages per claim under the fault mix. Bounded by
    statement_timestamp(), it walks the index in order, stops at its limit and marks the dead
    entries it passed, so the next claim skips them without visiting the heap."""
    import json

    import psycopg
    from sqlalchemy.engine import make_url

    from outbox.ledger.drivers import pg_statements as sql
    from outbox.ledger.states import AttemptKind
    from tests.harness import wait_for

    # No VACUUM of its own while it waits below: one would remove the dead entries the test counts on
    # the claims to mark (autovacuum is not held back by transactions of other databases).
    _no_autovacuum(lone_pg_ledger)
    with lone_pg_ledger.sessions.begin() as s:
        for n in range(2000):
            submit(s, **(INTENT | {"idempotency_key": f"churn-{n}"}))
    with lone_pg_ledger.engine.begin() as conn:
        conn.execute(text(f"ANALYZE {OPERATIONS}"))
    for _ in range(195):  # 1,950 claimed: their due-index entries are dead, 50 rows still due
        assert len(_claim(lone_pg_ledger, limit=10)) == 10
    url = make_url(lone_pg_ledger.url).set(drivername="postgresql").render_as_string(hide_password=False)
    # The claim workers send: the tenants' walk, then each tenant's due rows through the fair index.
    statement = sql.claim(AttemptKind.DISPATCH, False, 10, 0, True)
    params = {"worker": "probe", "lease_s": 30, "after_tenant": "", "weight_tenants": [], "weights": []}
    params["versions"] = None  # the workers' versions of the actions, for the attempt rows
    with psycopg.connect(url) as conn:
        # Marking waits until the claims' dead versions are older than every snapshot, and a snapshot
        # starts from the oldest running transaction that has written, in any database of the server:
        # another test process's long transaction, in a database of its own, holds the marking back
        # for its whole life (CI, 2026-12-07: 108 pages on every try; docs/how-to/deploy.md). Measured
        # once every transaction older than the claims has ended (said when one outlives the wait:
        # that is a server the test cannot measure on).
        (after_claims,) = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        conn.commit()

        def oldest_running() -> int:
            (xmin,) = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
            conn.commit()
            return int(xmin)

        wait_for(
            lambda: oldest_running() > after_claims,
            120,
            what=lambda: f"every transaction older than the claims ended: {_older_than(conn, after_claims)}",
        )

        def heap_pages_read() -> int:
            """Shared buffers the claim's scans of due rows touched (rolled back: nothing claimed)."""
            with conn.transaction(force_rollback=True):
                (plan,) = conn.execute(
                    f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", params | {"operation_ids": []}
                ).fetchone()
            nodes, touched, rows_scan = (
                [json.loads(plan)[0]["Plan"] if isinstance(plan, str) else plan[0]["Plan"]],
                0,
                0,
            )
            while nodes:
                node = nodes.pop()
                if node.get("Index Name") == f"ix_{OPERATIONS}_fair_due":
                    touched += int(node["Shared Hit Blocks"]) + int(node.get("Shared Read Blocks", 0))
                    if node["Node Type"] == "Index Scan":  # a tenant's rows, bounded by the due time
                        assert "statement_timestamp()" in node.get("Index Cond", ""), node
                        rows_scan += 1
                nodes.extend(node.get("Plans", []))
            assert rows_scan, f"no scan of a tenant's due rows in {plan}"
            return touched

        # A scan marks the dead entries it passes once PostgreSQL sees them dead to every snapshot;
        # its view of that horizon is refreshed lazily, so on a busy server the marking may take a
        # scan or two more. Pages touched: 24 on a quiet machine, 38 with six test processes on two
        # cores (2026-12-06); the index scan bounded by statement_timestamp() (asserted above, node by
        # node) is what keeps it there, and a bitmap scan of the whole index reads hundreds.
        touched = [heap_pages_read() for _ in range(4)]
        assert min(touched[1:]) < 100, touched
