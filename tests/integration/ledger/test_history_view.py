"""An operation's history reads the same whether its moves were written as event rows or recorded on
attempt and operation rows (outbox/ledger/history.py): PostgreSQL records a claim and the move its
attempt's result made on the attempt row and the submit on the operation row, SQLite writes them as
rows, and ``outbox_history`` shows both as the same events, in the order they were written. A
downgrade (through migrations 0016 and 0015) and an upgrade keep every event."""

from __future__ import annotations

import uuid
from decimal import Decimal

from sqlalchemy import select, update

from outbox import migrate
from outbox.evidence.settlement import SettlementMove, settle_many_if_fenced
from outbox.ledger.claims import claim_due, claim_unknown
from outbox.ledger.clock import db_now
from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.history import HistoryEvent
from outbox.ledger.models import Attempt, Operation, OperationEvent
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from outbox.reads.queries import explain
from producer import submit
from tests.conftest import scratch_pg_database

INTENT = dict(
    tenant="acme",
    idempotency_key="hist-1",
    action="payments.refund.create",
    args={"order_id": "o-1", "amount": Decimal("5.00"), "currency": "EUR"},
    subject="agent:bot",
)
# submit, a 503 (sent again), a timeout (outcome unknown), a lookup that finds it.
EXPECTED = [
    (None, "not_dispatched", "submit", "subject agent:bot", "agent:bot"),
    ("not_dispatched", "dispatching", "claim", "dispatch attempt 1", "w1"),
    ("dispatching", "not_dispatched", "attempt result", "attempt 1 not_processed: 503; again", "w1"),
    ("not_dispatched", "dispatching", "claim", "dispatch attempt 2", "w2"),
    ("dispatching", "outcome_unknown", "attempt result", "attempt 2 ambiguous: timeout", "w2"),
    ("outcome_unknown", "outcome_unknown", "reconcile claim", "lookup attempt 1", "rec"),
    ("outcome_unknown", "succeeded", "lookup result", "lookup 1 succeeded: found", "rec"),
]


def _history(sessions, op_id, model=HistoryEvent):
    with sessions() as s:
        rows = s.execute(
            select(model.from_status, model.to_status, model.event, model.reason, model.actor)
            .where(model.operation_id == op_id)
            .order_by(model.id)
        ).all()
    return [tuple(r) for r in rows]


def _to_unknown(sessions) -> str:
    """Submit, a 503, a timeout: the operation parked outcome_unknown, a lookup claimed."""
    with sessions.begin() as s:
        op_id = submit(s, **INTENT).operation_id
    for worker, to, report, reason in (
        ("w1", Status.NOT_DISPATCHED, AttemptReport(AttemptClass.NOT_PROCESSED, status_code=503), "503; again"),
        ("w2", Status.OUTCOME_UNKNOWN, AttemptReport(AttemptClass.AMBIGUOUS, error="read timeout"), "timeout"),
    ):
        with sessions.begin() as s:
            [c] = claim_due(s, worker=worker, lease_s=30, operation_ids=[op_id], limit=1)
        with sessions.begin() as s:
            finalize_if_fenced(s, c, report, to=to, reason=reason)
    return op_id


def _lookup(sessions, op_id: str):
    with sessions.begin() as s:
        s.execute(update(Operation).where(Operation.id == op_id).values(next_attempt_at=db_now(-1)))
    with sessions.begin() as s:
        [r] = claim_unknown(s, worker="rec", lease_s=30, operation_id=op_id)
    return r


def _found(sessions, lookup) -> None:
    """The reconciler's settlement (one statement per operation: on PostgreSQL its move is recorded
    on the lookup's attempt row)."""
    report = AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_1")
    with sessions.begin() as s:
        [refused] = settle_many_if_fenced(
            s, [SettlementMove(lookup, report, Status.SUCCEEDED, "found", 0.0, {"id": "re_1"})]
        )
    assert refused is None


def test_every_move_is_in_the_history_in_order_on_both_backends(ledger):
    op_id = _to_unknown(ledger.sessions)
    _found(ledger.sessions, _lookup(ledger.sessions, op_id))
    assert _history(ledger.sessions, op_id) == EXPECTED
    with ledger.sessions() as s:
        shown = explain(s, op_id).as_json()["history"]
    assert [(e["from"], e["to"], e["event"], e["reason"], e["actor"]) for e in shown] == EXPECTED
    rows = _history(ledger.sessions, op_id, OperationEvent)
    if ledger.engine.dialect.name == "postgresql":
        # The submit is recorded on the operation row, the claims and the moves of attempt and
        # lookup results on the attempt rows: the event table holds none of them.
        assert rows == []
    else:
        assert rows == EXPECTED


def test_a_move_no_open_attempt_row_can_record_is_an_event_row(pg_ledger):
    with pg_ledger.sessions.begin() as s:
        op_id = submit(s, **INTENT).operation_id
    with pg_ledger.sessions.begin() as s:
        [c] = claim_due(s, worker="w1", lease_s=30, operation_ids=[op_id], limit=1)
        # The attempt row already ended (no path of the ledger does this today: the finalize's
        # fallback for one that did): the move must still be told, as an event row.
        s.execute(update(Attempt).where(Attempt.id == c.attempt_id).values(ended_at=db_now()))
    with pg_ledger.sessions.begin() as s:
        report = AttemptReport(AttemptClass.SUCCEEDED, status_code=201, provider_reference="re_1")
        finalize_if_fenced(s, c, report, to=Status.SUCCEEDED, reason="2xx", result={"id": "re_1"})
    moves = [r for r in _history(pg_ledger.sessions, op_id) if r[2] == "attempt result"]
    assert moves == [("dispatching", "succeeded", "attempt result", "attempt 1 succeeded: 2xx", "w1")]
    assert moves == [r for r in _history(pg_ledger.sessions, op_id, OperationEvent) if r[2] == "attempt result"]


def test_a_downgrade_writes_the_recorded_events_as_rows_and_an_upgrade_reads_them_again():
    with scratch_pg_database(f"outbox_test_history_{uuid.uuid4().hex[:10]}") as url:
        engine = make_engine(url)
        try:
            sessions = make_sessionmaker(engine)
            op_id = _to_unknown(sessions)
            lookup = _lookup(sessions, op_id)  # in flight across the downgrade and the upgrade
            before = _history(sessions, op_id)
            assert before == EXPECTED[:6]
            migrate.downgrade(engine, "0014")
            engine.dispose()  # the columns are gone: no cached statement may name them
            with engine.connect() as conn:
                rows = conn.exec_driver_sql(
                    "SELECT from_status, to_status, event, reason, actor FROM outbox_operation_events"
                    " WHERE operation_id = %(id)s ORDER BY id",
                    {"id": op_id},
                ).all()
            assert [tuple(r) for r in rows] == before
            migrate.upgrade(engine)
            engine.dispose()
            # The lookup claimed before (its claim now an event row) settles after: its move is
            # recorded on its attempt row again, from the status it was claimed in.
            _found(sessions, lookup)
            assert _history(sessions, op_id) == EXPECTED
            with sessions() as s:
                row = s.get(Attempt, lookup.attempt_id)
                assert (row.claim_event_id, row.claimed_from, row.moved_to) == (None, "outcome_unknown", "succeeded")
                assert row.move_event_id is not None
        finally:
            engine.dispose()


def test_a_submit_is_in_the_history_with_the_status_it_entered_and_a_replay_adds_nothing(ledger):
    with ledger.sessions.begin() as s:
        op_id = submit(
            s, **dict(INTENT, idempotency_key="hist-approve"), requires_approval=True, run_id="r-7"
        ).operation_id
    with ledger.sessions.begin() as s:
        assert not submit(s, **dict(INTENT, idempotency_key="hist-approve"), requires_approval=True, run_id="r-7").new
    assert _history(ledger.sessions, op_id) == [
        (None, "awaiting_approval", "submit", "subject agent:bot, run r-7", "agent:bot")
    ]
    with ledger.sessions() as s:
        [event] = s.execute(select(HistoryEvent).where(HistoryEvent.operation_id == op_id)).scalars()
        op = s.get(Operation, op_id)
        assert (event.at, event.fencing_token) == (op.created_at, 0)
