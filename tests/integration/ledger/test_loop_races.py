"""Every maintenance loop re-checks what it read: its write is a compare-and-set on state and token.

Each test cuts a loop between its read and its write (the failpoint ``*.after_select_before_update``,
run in-process) and, right there, finishes or re-claims the row from another session, as another
process would. The loop's write must then touch nothing: no move, no event, no stamp.

PostgreSQL only: on SQLite every transaction holds the one write lock from its first statement
(BEGIN IMMEDIATE), so no other writer can get between a loop's read and its write there.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select, update

from breaker import Open
from outbox.errors import StaleFence
from outbox.evidence.late_successes import LATE_EVIDENCE_EVENT, apply_unapplied
from outbox.evidence.sinks import EvidenceSink, backfill
from outbox.ledger import failpoints
from outbox.ledger.claims import claim_due, claim_unknown
from outbox.ledger.clock import db_now
from outbox.ledger.history import HistoryEvent
from outbox.ledger.leases import expire_leases
from outbox.ledger.models import Attempt, Evidence, Operation
from outbox.ledger.states import AttemptClass, EventKind, Status, WaitingFor
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from producer import submit
from workers.dispatch.gate import park_while_open_if_due
from workers.provider.actions import load_actions

pytestmark = pytest.mark.postgres

ACTIONS = Path(__file__).resolve().parents[3] / "examples" / "actions.yaml"
SUCCESS = AttemptReport(AttemptClass.SUCCEEDED, status_code=201, provider_reference="re_1")


def _submit(ledger, key="k1"):
    with ledger.sessions.begin() as s:
        return submit(
            s,
            tenant="acme",
            idempotency_key=key,
            action="payments.refund.create",
            args={"order_id": key, "amount": Decimal("5.00"), "currency": "EUR"},
            subject="agent:bot",
        ).operation_id


def _events(ledger, op_id):
    with ledger.sessions() as s:
        return (
            s.execute(select(HistoryEvent.event).where(HistoryEvent.operation_id == op_id).order_by(HistoryEvent.id))
            .scalars()
            .all()
        )


def _op(ledger, op_id):
    with ledger.sessions() as s:
        return s.get(Operation, op_id)


def _claim_with_expired_lease(ledger, op_id):
    with ledger.sessions.begin() as s:
        [c] = claim_due(s, worker="owner", lease_s=30, operation_id=op_id)
        s.execute(update(Operation).where(Operation.id == op_id).values(lease_expires_at=db_now(-1)))
    return c


def test_lease_expiry_leaves_alone_a_row_its_owner_finished_meanwhile(pg_ledger):
    op_id = _submit(pg_ledger)
    owner = _claim_with_expired_lease(pg_ledger, op_id)

    def owner_finishes(_key):
        with pg_ledger.sessions.begin() as s:
            finalize_if_fenced(s, owner, SUCCESS, to=Status.SUCCEEDED, reason="2xx")

    with failpoints.on("sweep.after_select_before_update", owner_finishes), pg_ledger.sessions.begin() as s:
        assert expire_leases(s) == []
    assert _op(pg_ledger, op_id).status == Status.SUCCEEDED
    assert EventKind.LEASE_EXPIRED not in _events(pg_ledger, op_id)


def test_lease_expiry_leaves_alone_a_row_another_sweep_moved_and_the_reconciler_claimed(pg_ledger):
    op_id = _submit(pg_ledger)
    _claim_with_expired_lease(pg_ledger, op_id)
    taken = {}

    def another_sweep_and_reconciler(_key):
        with pg_ledger.sessions.begin() as s:
            assert expire_leases(s) == [op_id]
        with pg_ledger.sessions.begin() as s:
            [taken["r"]] = claim_unknown(s, worker="reconciler", lease_s=30, operation_id=op_id)

    with failpoints.on("sweep.after_select_before_update", another_sweep_and_reconciler):
        with pg_ledger.sessions.begin() as s:
            assert expire_leases(s) == []
    op = _op(pg_ledger, op_id)
    assert op.status == Status.OUTCOME_UNKNOWN and op.lease_owner == "reconciler"
    assert op.fencing_token == taken["r"].fencing_token
    assert _events(pg_ledger, op_id).count(EventKind.LEASE_EXPIRED) == 1


def test_late_evidence_is_applied_once_when_another_sweep_applies_it_meanwhile(pg_ledger):
    op_id = _submit(pg_ledger)
    zombie = _claim_with_expired_lease(pg_ledger, op_id)
    with pg_ledger.sessions.begin() as s:
        assert expire_leases(s) == [op_id]
    with pg_ledger.sessions.begin() as s, pytest.raises(StaleFence):
        # The frozen worker's 2xx arrives late: evidence on its (now stale) attempt row.
        finalize_if_fenced(s, zombie, SUCCESS, to=Status.SUCCEEDED, reason="2xx")
    sink = EvidenceSink(None)

    def packet(_s, _op, why):
        return {"why": why}

    def stamp():
        with pg_ledger.sessions() as s:
            return s.execute(select(Attempt.applied_at).where(Attempt.id == zombie.attempt_id)).scalar_one()

    first = {}

    def another_sweep(_key):
        assert apply_unapplied(pg_ledger.sessions, actor="other sweep", sink=sink, packet=packet) == {
            op_id: Status.SUCCEEDED
        }
        first["stamp"] = stamp()

    with failpoints.on("late_evidence.after_select_before_update", another_sweep):
        assert apply_unapplied(pg_ledger.sessions, actor="sweep", sink=sink, packet=packet) == {}
    assert _op(pg_ledger, op_id).status == Status.SUCCEEDED
    assert _events(pg_ledger, op_id).count(LATE_EVIDENCE_EVENT) == 1
    # Stamped once, by the sweep that applied it: the second one's compare-and-set touched nothing.
    assert first["stamp"] is not None and stamp() == first["stamp"]


def test_evidence_backfill_writes_each_record_once_when_another_backfill_runs_meanwhile(pg_ledger, tmp_path):
    op_id = _submit(pg_ledger)
    with pg_ledger.sessions.begin() as s:
        [c] = claim_due(s, worker="w", lease_s=30, operation_id=op_id)
        # The provider confirmed; the separate evidence store was down.
        finalize_if_fenced(s, c, SUCCESS, to=Status.COMMITTED_EVIDENCE_DEGRADED, reason="2xx, evidence store down")
    sink = EvidenceSink.from_url(f"sqlite:///{tmp_path / 'evidence.db'}")
    other = {}

    def another_backfill(_key):
        with pg_ledger.sessions.begin() as s:
            other["result"] = backfill(s, sink, actor="other relay")

    try:
        with failpoints.on("backfill.after_select_before_update", another_backfill):
            with pg_ledger.sessions.begin() as s:
                assert backfill(s, sink, actor="relay") == (1, 0)
        assert other["result"] == (0, 0)  # the row was taken: skipped, not written twice
        with sink.engine.connect() as conn:
            records = conn.execute(select(Evidence.operation_id)).scalars().all()
    finally:
        sink.close()
    assert records == [op_id]
    assert _op(pg_ledger, op_id).status == Status.SUCCEEDED
    assert _events(pg_ledger, op_id).count(EventKind.EVIDENCE_BACKFILLED) == 1


def test_breaker_park_leaves_alone_a_row_another_worker_claimed_meanwhile(pg_ledger):
    op_id = _submit(pg_ledger)
    action = load_actions(ACTIONS).action("payments.refund.create")
    now = dt.datetime.now(dt.UTC)
    decision = Open(target=action.target, reopens_at=now + dt.timedelta(seconds=30), storage="local", wait_s=30)
    taken = {}

    def another_worker_claims(_key):
        with pg_ledger.sessions.begin() as s:
            [taken["c"]] = claim_due(s, worker="other", lease_s=30, operation_id=op_id)

    with failpoints.on("gate.after_select_before_update", another_worker_claims):
        assert (
            park_while_open_if_due(
                pg_ledger.sessions, op_id, action, decision, actor="parker", spent_attempts=0, now=now
            )
            is None
        )
    op = _op(pg_ledger, op_id)
    assert op.status == Status.DISPATCHING and op.lease_owner == "other"
    assert op.fencing_token == taken["c"].fencing_token and op.waiting_for is None
    assert EventKind.BREAKER_OPEN not in _events(pg_ledger, op_id)


def test_breaker_park_then_reset_wakes_only_what_the_breaker_parked(pg_ledger):
    parked, retrying = _submit(pg_ledger, "parked"), _submit(pg_ledger, "retrying")
    action = load_actions(ACTIONS).action("payments.refund.create")
    now = dt.datetime.now(dt.UTC)
    decision = Open(target=action.target, reopens_at=now + dt.timedelta(seconds=30), storage="local", wait_s=30)
    assert (
        park_while_open_if_due(pg_ledger.sessions, parked, action, decision, actor="parker", spent_attempts=0, now=now)
        is not None
    )
    with pg_ledger.sessions.begin() as s:
        [c] = claim_due(s, worker="w", lease_s=30, operation_id=retrying)
        report = AttemptReport(AttemptClass.NOT_PROCESSED, status_code=503, retry_after_s=30)
        finalize_if_fenced(
            s, c, report, to=Status.NOT_DISPATCHED, reason="503", delay_s=30, waiting_for=WaitingFor.RETRY_AFTER
        )
    assert _op(pg_ledger, parked).waiting_for == WaitingFor.BREAKER
    assert _op(pg_ledger, retrying).waiting_for == WaitingFor.RETRY_AFTER
    from outbox.ledger.waits import wake_breaker_waits

    with pg_ledger.sessions.begin() as s:
        assert wake_breaker_waits(s, ["payments.refund.create"], reason="reset by ops", actor="ops") == [parked]
    assert _op(pg_ledger, parked).waiting_for is None
    assert _events(pg_ledger, parked)[-2:] == [EventKind.BREAKER_OPEN, EventKind.BREAKER_RESET]
